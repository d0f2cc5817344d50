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

// [B] is one request's row, [R, B] a batch's.
trtspec::Rows<int64_t> rows(const Int64Array& a) {
    if (a.ndim() == 1) return {a.data(), 1, a.shape(0), 0, a.stride(0)};
    if (a.ndim() == 2) return {a.data(), a.shape(0), a.shape(1), a.stride(0), a.stride(1)};
    throw std::invalid_argument("posterior tokens must be [B] or [R, B]");
}

size_t step_greedy(Controller& c, const FloatArray& logits) {
    // [B, V] for one request, [R, B, V] for a batch; each vocabulary row contiguous.
    const size_t n = logits.ndim();
    if (n != 2 && n != 3) throw std::invalid_argument("logits must be [B, V] or [R, B, V]");
    if (logits.stride(n - 1) != 1) throw std::invalid_argument("logits rows must be contiguous");
    const size_t batch = n == 3 ? logits.shape(0) : 1;
    if (batch != c.requests()) throw std::invalid_argument("logits hold another number of requests");
    for (size_t r = 0; r < c.requests(); ++r)
        if (c.finish(r) == Finish::running && logits.shape(n - 2) < static_cast<size_t>(c.block_size(r)))
            throw std::invalid_argument("logits hold fewer positions than the block");
    const size_t block_stride = n == 3 ? static_cast<size_t>(logits.stride(0)) : 0;
    return c.step_greedy(logits.data(), block_stride, logits.stride(n - 2), logits.shape(n - 1));
}

// "" while the request runs, then "stop" or "length" (the names DecodeStats reports).
const char* finish_reason(const Controller& c, size_t r) {
    switch (c.finish(r)) {
        case Finish::stop: return "stop";
        case Finish::length: return "length";
        default: return "";
    }
}

Int64View view(Controller& c, int64_t* data, size_t cols) {
    return Int64View(data, {c.requests(), cols});
}

}  // namespace

NB_MODULE(_native, m) {
    m.doc() = "trtspec's native decode controller: accept, commit, stops and statistics per cycle";
    nb::class_<Controller>(m, "Controller")
        .def(nb::init<std::vector<int64_t>, std::vector<int64_t>, const std::vector<std::vector<int64_t>>&,
                      int64_t, std::vector<int64_t>>(),
             nb::arg("block_sizes"), nb::arg("limits"), nb::arg("stop_ids"), nb::arg("mask_token_id"),
             nb::arg("grow_to") = std::vector<int64_t>())
        .def("begin", &Controller::begin, nb::arg("request"), nb::arg("token"), nb::arg("start"))
        .def("set_block_size", &Controller::set_block_size, nb::arg("request"), nb::arg("size"))
        .def("step", [](Controller& c, const Int64Array& posterior) { return c.step(rows(posterior)); },
             nb::arg("posterior"), nb::call_guard<nb::gil_scoped_release>())
        .def("step_greedy", &step_greedy, nb::arg("logits"), nb::call_guard<nb::gil_scoped_release>())
        .def_prop_ro("requests", &Controller::requests)
        .def_prop_ro("running", &Controller::running)
        .def("block_size", &Controller::block_size)
        .def("grown_cycles", &Controller::grown_cycles)
        .def("ceilings", &Controller::ceilings)
        .def("count", &Controller::count)
        .def("start", &Controller::start)
        .def("accepted", &Controller::accepted)
        .def("committed", &Controller::committed)
        .def("finish_reason", &finish_reason, nb::arg("request"))
        .def("cycles", &Controller::cycles)
        .def("tau", &Controller::tau)
        .def("ceiling_fraction", &Controller::ceiling_fraction)
        .def_prop_ro("verify_blocks", [](Controller& c) { return view(c, c.verify_blocks(), c.width()); },
                     nb::rv_policy::reference_internal)
        .def_prop_ro("draft_blocks", [](Controller& c) { return view(c, c.draft_blocks(), c.width()); },
                     nb::rv_policy::reference_internal)
        .def_prop_ro("tokens", [](Controller& c) { return view(c, c.tokens(), c.capacity()); },
                     nb::rv_policy::reference_internal)
        .def_prop_ro("histograms", [](Controller& c) { return view(c, c.histograms(), c.width()); },
                     nb::rv_policy::reference_internal);
}
