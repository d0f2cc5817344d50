// Python bindings of the decode controller: buffers are shared as numpy arrays (no copies), and
// step() reads numpy arrays or torch CPU tensors in place through DLPack.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "controller.hpp"

namespace nb = nanobind;
using trtspec::Controller;
using trtspec::Finish;

namespace {

using Int64Array = nb::ndarray<const int64_t, nb::device::cpu>;
using FloatArray = nb::ndarray<const float, nb::device::cpu>;
using Int64View = nb::ndarray<nb::numpy, int64_t>;

bool step(Controller& c, const Int64Array& posterior) {  // [B]
    if (posterior.ndim() != 1) throw std::invalid_argument("posterior tokens must be [B]");
    return c.step(posterior.data(), posterior.shape(0), posterior.stride(0));
}

bool step_greedy(Controller& c, const FloatArray& logits) {  // [B, V], each vocabulary row contiguous
    if (logits.ndim() != 2) throw std::invalid_argument("logits must be [B, V]");
    if (logits.stride(1) != 1) throw std::invalid_argument("logits rows must be contiguous");
    return c.step_greedy(logits.data(), logits.shape(0), logits.stride(0), logits.shape(1));
}

// "" while the request runs, then "stop" or "length" (the names DecodeStats reports).
const char* finish_reason(const Controller& c) {
    switch (c.finish()) {
        case Finish::stop: return "stop";
        case Finish::length: return "length";
        default: return "";
    }
}

}  // namespace

NB_MODULE(_native, m) {
    m.doc() = "trtspec's native decode controller: accept, commit, stops and statistics per cycle";
    nb::class_<Controller>(m, "Controller")
        .def(nb::init<int64_t, int64_t, std::vector<int64_t>, int64_t, int64_t>(),
             nb::arg("block_size"), nb::arg("limit"), nb::arg("stop_ids"), nb::arg("mask_token_id"),
             nb::arg("grow_to") = 0)
        .def("begin", &Controller::begin, nb::arg("token"), nb::arg("start"))
        .def("set_block_size", &Controller::set_block_size, nb::arg("size"))
        .def("narrow", &Controller::narrow, nb::arg("width"))
        .def("step", &step, nb::arg("posterior"), nb::call_guard<nb::gil_scoped_release>())
        .def("step_greedy", &step_greedy, nb::arg("logits"), nb::call_guard<nb::gil_scoped_release>())
        .def_prop_ro("running", &Controller::running)
        .def_prop_ro("block_size", &Controller::block_size)
        .def_prop_ro("next_width", &Controller::next_width)
        .def_prop_ro("drafts", &Controller::drafts)
        .def_prop_ro("grown_cycles", &Controller::grown_cycles)
        .def_prop_ro("ceilings", &Controller::ceilings)
        .def_prop_ro("count", &Controller::count)
        .def_prop_ro("start", &Controller::start)
        .def_prop_ro("accepted", &Controller::accepted)
        .def_prop_ro("committed", &Controller::committed)
        .def_prop_ro("finish_reason", &finish_reason)
        .def_prop_ro("cycles", &Controller::cycles)
        .def_prop_ro("tau", &Controller::tau)
        .def_prop_ro("ceiling_fraction", &Controller::ceiling_fraction)
        .def_prop_ro("verify_block", [](Controller& c) { return Int64View(c.verify_block(), {c.width()}); },
                     nb::rv_policy::reference_internal)
        .def_prop_ro("draft_block", [](Controller& c) { return Int64View(c.draft_block(), {c.width()}); },
                     nb::rv_policy::reference_internal)
        .def_prop_ro("tokens", [](Controller& c) { return Int64View(c.tokens(), {c.capacity()}); },
                     nb::rv_policy::reference_internal)
        .def_prop_ro("histogram", [](Controller& c) { return Int64View(c.histogram(), {c.width()}); },
                     nb::rv_policy::reference_internal);
}
