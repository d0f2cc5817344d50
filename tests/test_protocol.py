"""The OpenAI wire format read without a server: `protocol.parse_request` and the utility routes'
parsers called directly on decoded bodies, and `body.decode_body` on raw bytes. What a real server
does with the result is tests/test_serve.py's and tests/test_serve_door.py's."""

from __future__ import annotations

import pytest

from trtspec.runtime.request import DEFAULT_MAX_TOKENS
from trtspec.runtime.schedule import BlockChoice
from trtspec.serving.body import decode_body
from trtspec.serving.protocol import ApiError, parse_detokenize, parse_request, parse_tokenize
from trtspec.tokenizer import TextCodec

CONTEXT = 4096
DEFAULT_BLOCK = BlockChoice(8)


@pytest.fixture(scope="module")
def codec(target_dir) -> TextCodec:
    return TextCodec(target_dir)


def completion(codec, **fields):
    return parse_request({"model": "m", "prompt": "x = 1", **fields}, codec, DEFAULT_BLOCK, chat=False,
                         max_context=CONTEXT)


def chat(codec, **fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_request(body, codec, DEFAULT_BLOCK, chat=True, max_context=CONTEXT)


def refusal(call, *args, **fields) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call(*args, **fields)
    assert caught.value.status == 400
    return caught.value


def test_a_completion_prompt_becomes_its_token_ids(codec):
    assert completion(codec).prompt_ids == codec.encode_unlocked("x = 1")


def test_a_prompt_of_token_ids_is_taken_as_given(codec):
    assert completion(codec, prompt=[5, 6, 7]).prompt_ids == [5, 6, 7]


def test_unset_fields_take_their_defaults(codec):
    config = completion(codec).config
    assert (config.block, config.sampling.temperature, config.sampling.top_p, config.sampling.top_k) == \
        (DEFAULT_BLOCK, 0.0, 1.0, 0)


@pytest.mark.parametrize("route", [completion, chat])
def test_both_routes_default_to_the_same_token_limit(codec, route):
    assert route(codec).config.max_new_tokens == DEFAULT_MAX_TOKENS


def test_a_field_of_the_wrong_kind_is_refused_naming_it(codec):
    assert refusal(completion, codec, ignore_eos=1).param == "ignore_eos"


def test_a_chat_token_limit_out_of_range_names_the_field_given(codec):
    assert refusal(chat, codec, max_completion_tokens=0).param == "max_completion_tokens"


def test_chat_messages_with_text_parts_read_as_their_joined_text(codec):
    parts = chat(codec, messages=[{"role": "user", "content": [{"type": "text", "text": "h"},
                                                              {"type": "text", "text": "i"}]}])
    assert parts.prompt_ids == chat(codec).prompt_ids


def test_max_completion_tokens_wins_over_max_tokens(codec):
    assert chat(codec, max_tokens=5, max_completion_tokens=7).config.max_new_tokens == 7


def test_an_unknown_field_is_refused_by_name(codec):
    error = refusal(completion, codec, colour="blue")
    assert error.param == "colour" and "unknown field 'colour'" in error.message


def test_an_unsupported_field_at_its_default_is_accepted(codec):
    assert completion(codec, best_of=1).n == 1


def test_an_unsupported_field_off_its_default_is_refused(codec):
    assert refusal(completion, codec, best_of=2).param == "best_of"


@pytest.mark.parametrize("name, value", [("temperature", -1), ("top_p", 0), ("top_k", -2), ("n", 0),
                                         ("max_tokens", 0), ("presence_penalty", 3), ("seed", -1),
                                         ("min_p", 2), ("repetition_penalty", 0), ("logprobs", 21)])
def test_an_out_of_range_number_is_refused_naming_its_field(codec, name, value):
    assert refusal(completion, codec, **{name: value}).param == name


def test_min_tokens_above_the_token_limit_is_refused(codec):
    assert refusal(completion, codec, max_tokens=4, min_tokens=5).param == "min_tokens"


def test_a_block_size_string_is_parsed_into_a_block_choice(codec):
    assert completion(codec, block_size="AR").config.block == BlockChoice.parse("AR", allow_ar=True)


def test_stop_strings_are_kept_for_the_text(codec):
    assert completion(codec, stop=["\n\n", "END"]).config.stop == ("\n\n", "END")


def test_stop_token_ids_join_the_engine_stop_ids(codec):
    assert set(completion(codec, stop_token_ids=[3, 4]).config.stop_ids) >= {3, 4}


def test_each_seeded_choice_samples_with_its_own_seed(codec):
    parsed = completion(codec, n=3, seed=11, temperature=1.0)
    seeds = [parsed.choice_config(i).sampling.seed for i in range(3)]
    assert seeds[0] == 11 and len(set(seeds)) == 3


def test_a_prompt_the_context_cannot_hold_is_refused_before_it_is_tokenized(codec):
    error = refusal(completion, codec, prompt="word " * (codec.text_bytes_cap(CONTEXT) // 5 + 1))
    assert error.param == "prompt" and "characters" in error.message


def test_asking_for_more_tokens_than_the_context_leaves_is_refused(codec):
    assert refusal(completion, codec, max_tokens=CONTEXT).param == "max_tokens"


def test_logit_bias_keys_must_be_token_ids(codec):
    assert refusal(completion, codec, logit_bias={"word": 1}).param == "logit_bias"


def test_a_logit_bias_out_of_range_is_refused(codec):
    assert refusal(completion, codec, logit_bias={"5": 101}).param == "logit_bias"


def test_chat_logprobs_take_their_top_count(codec):
    assert chat(codec, logprobs=True, top_logprobs=3).config.logprobs == 3


def test_a_chat_top_logprobs_out_of_range_names_top_logprobs(codec):
    assert refusal(chat, codec, logprobs=True, top_logprobs=21).param == "top_logprobs"


def test_tokenize_reads_a_prompt(codec):
    assert parse_tokenize({"prompt": "x = 1"}, codec, CONTEXT) == codec.encode_unlocked("x = 1")


def test_detokenize_refuses_ids_outside_the_vocabulary(codec):
    vocab = codec.tokenizer.get_vocab_size(with_added_tokens=True)
    assert refusal(parse_detokenize, {"tokens": [vocab]}, vocab).param == "tokens"


@pytest.mark.parametrize("raw, says", [(b"\xff{}", "not UTF-8"), (b'{"a": ', "not valid JSON"),
                                       (b"[" * 100_000, "nested too deeply"), (b'{"stop": "\\ud800"}', "stop")])
def test_a_body_that_is_not_json_text_is_refused(raw, says):
    assert says in refusal(decode_body, raw).message


def test_a_large_body_of_too_many_values_is_refused():
    raw = b"[" + b",".join([b"[]"] * 200_000) + b"]"
    assert "more than 1000 JSON values" in refusal(decode_body, raw, 1000).message
