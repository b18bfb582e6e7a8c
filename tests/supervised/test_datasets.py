"""SFT / preference loading against hand-computed ids of the byte tokenizer (id == byte value, EOS == 258).

Expected ids are written out from the texts OpenRLHF 0.11.2 builds (SFTDataset / RewardDataset):
`(prompt + response).rstrip("\\n")` then `" " + eos` unless the text already ends with EOS, cut to max_len
with EOS as the last id, split where the prompt alone ends.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlrun.models.tiny import CHAT_TEMPLATE, build_byte_tokenizer
from rlrun.runtime.errors import DataError
from rlrun.supervised.datasets import Completion, Loaded, Preference, load_completions, load_preferences

EOS = 258
SPACE = 32
# Turns end with a newline (no EOS): the loader appends " <|eos|>" to the stripped text.
BRACKET_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def b(text: str) -> list[int]:
    """Byte tokenizer ids of `text` (ASCII only): the byte values."""
    return list(text.encode("ascii"))


def write_jsonl(tmp_path: Path, records: list[Any], name: str = "data.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return str(path)


def tokenizer(template: str | None = BRACKET_TEMPLATE) -> Any:
    tok = build_byte_tokenizer()
    tok.chat_template = template
    return tok


def sft(path: str, tok: Any = None, **overrides: Any) -> Loaded[Completion]:
    kwargs: dict[str, Any] = dict(
        input_key="input", output_key="output", input_template=None, apply_chat_template=False,
        pretrain_mode=False, max_len=64, max_samples=1000,
    )
    kwargs.update(overrides)
    return load_completions(path, tok if tok is not None else tokenizer(), **kwargs)


def pairs(path: str, tok: Any = None, **overrides: Any) -> Loaded[Preference]:
    kwargs: dict[str, Any] = dict(
        prompt_key="prompt", chosen_key="chosen", rejected_key="rejected", input_template=None,
        apply_chat_template=False, max_len=64, max_samples=1000,
    )
    kwargs.update(overrides)
    return load_preferences(path, tok if tok is not None else tokenizer(), **kwargs)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


# --------------------------------------------------------------------------------------------------------------
# SFT, plain text


def test_sft_template_and_space_eos(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{"input": "hi", "output": "yo"}])
    loaded = sft(path, input_template="Q: {}\nA: ")
    # "Q: hi\nA: " | "yo" + " <|eos|>"
    assert loaded.samples == [
        Completion(prompt=[81, 58, 32, 104, 105, 10, 65, 58, 32], response=[121, 111, SPACE, EOS])
    ]
    assert (loaded.dropped, loaded.truncated) == (0, 0)


def test_sft_strips_trailing_newlines_and_keeps_existing_eos(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{"input": "a", "output": "yo\n\n"}, {"input": "a", "output": "yo<|eos|>\n"}])
    loaded = sft(path)
    assert loaded.samples == [
        Completion(prompt=[97], response=[121, 111, SPACE, EOS]),
        Completion(prompt=[97], response=[121, 111, EOS]),  # already ends with EOS: none added, no space
    ]


def test_sft_filters_and_truncates_like_openrlhf(tmp_path: Path) -> None:
    records = [
        {"input": "ab", "output": "yo"},  # "Q: ab\nA: " = 9 tokens < 12 - 2: kept; 9 + 4 = 13 > 12: cut
        {"input": "abc", "output": "yo"},  # 10 prompt tokens >= 12 - 2: dropped
        {"input": "a", "output": ""},  # empty response: dropped
        {"input": "", "output": "yo"},  # templated prompt is not empty: kept
        {"input": "a", "output": "y"},  # 8 + 3 = 11 tokens: kept whole
    ]
    loaded = sft(write_jsonl(tmp_path, records), input_template="Q: {}\nA: ", max_len=12)
    assert loaded.samples == [
        Completion(prompt=b("Q: ab\nA: "), response=[121, 111, EOS]),  # " " cut, last id overwritten by EOS
        Completion(prompt=b("Q: \nA: "), response=[121, 111, SPACE, EOS]),
        Completion(prompt=b("Q: a\nA: "), response=[121, SPACE, EOS]),
    ]
    assert (loaded.dropped, loaded.truncated) == (2, 1)


def test_sft_drops_empty_prompt_without_template(tmp_path: Path) -> None:
    loaded = sft(write_jsonl(tmp_path, [{"input": "", "output": "yo"}, {"input": "a", "output": "b"}]))
    assert loaded.samples == [Completion(prompt=[97], response=[98, SPACE, EOS])]
    assert loaded.dropped == 1


def test_sft_max_samples_takes_the_first_records(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{"input": c, "output": "z"} for c in "abc"])
    loaded = sft(path, max_samples=2)
    assert [sample.prompt for sample in loaded.samples] == [[97], [98]]


# --------------------------------------------------------------------------------------------------------------
# SFT, pretrain mode


def test_pretrain_mode_trains_on_the_input_text_only(tmp_path: Path) -> None:
    records = [{"input": "abc", "output": "ignored"}, {"input": "", "output": "x"}, {"input": "de", "output": 1}]
    loaded = sft(write_jsonl(tmp_path, records), pretrain_mode=True, input_template="Q: {}", max_len=2,
                 apply_chat_template=True, tok=tokenizer(None))  # template and chat template are not used
    assert loaded.samples == [Completion(prompt=[], response=[97, 98]), Completion(prompt=[], response=[100, 101])]
    assert (loaded.dropped, loaded.truncated) == (1, 1)  # no EOS is written over the cut text


def test_pretrain_mode_needs_string_text(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"record 0 has 'input' = .*without --apply_chat_template it must be a string"):
        sft(write_jsonl(tmp_path, [{"input": [user("hi")]}]), pretrain_mode=True, output_key=None)


# --------------------------------------------------------------------------------------------------------------
# SFT, chat template


def test_sft_chat_template_wraps_strings_as_user_and_assistant(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{"input": "hi", "output": "yo"}])
    loaded = sft(path, apply_chat_template=True, input_template="ignored {}")
    # prompt "[user]hi\n[assistant]"; whole "[user]hi\n[assistant]yo\n" -> "yo" + " <|eos|>"
    assert loaded.samples == [Completion(prompt=b("[user]hi\n[assistant]"), response=[121, 111, SPACE, EOS])]


def test_sft_chat_template_ending_turns_with_eos_adds_no_second_eos(tmp_path: Path) -> None:
    loaded = sft(write_jsonl(tmp_path, [{"input": "hi", "output": "yo"}]), tokenizer(CHAT_TEMPLATE),
                 apply_chat_template=True)
    # whole "User: hi\nAssistant: yo<|eos|>\n": stripped, it already ends with EOS
    assert loaded.samples == [Completion(prompt=b("User: hi\nAssistant: "), response=[121, 111, EOS])]


def test_sft_message_lists_with_output_key(tmp_path: Path) -> None:
    record = {"input": [{"role": "system", "content": "s"}, user("hi")], "output": [assistant("yo")]}
    loaded = sft(write_jsonl(tmp_path, [record]), apply_chat_template=True)
    assert loaded.samples == [
        Completion(prompt=b("[system]s\n[user]hi\n[assistant]"), response=[121, 111, SPACE, EOS])
    ]


def test_sft_whole_conversation_in_input_key(tmp_path: Path) -> None:
    record = {"input": [user("a"), assistant("b"), user("c"), assistant("d")]}
    loaded = sft(write_jsonl(tmp_path, [record]), apply_chat_template=True, output_key=None)
    # Only the last assistant turn is trained on (OpenRLHF without --multiturn).
    assert loaded.samples == [
        Completion(prompt=b("[user]a\n[assistant]b\n[user]c\n[assistant]"), response=[100, SPACE, EOS])
    ]


def test_sft_conversation_not_ending_with_the_answer_is_an_error(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{"input": [user("a"), assistant("b"), user("c")]}])
    with pytest.raises(DataError, match=r"record 0: the rendered prompt .* is not the beginning of the rendered conversation"):
        sft(path, apply_chat_template=True, output_key=None)


def test_sft_chat_long_prompt_dropped(tmp_path: Path) -> None:
    # "[user]hi\n[assistant]" = 20 tokens >= 22 - 2: dropped; "[user]h\n[assistant]" = 19: kept, 19+4 > 22: cut
    path = write_jsonl(tmp_path, [{"input": "hi", "output": "yo"}, {"input": "h", "output": "yo"}])
    loaded = sft(path, apply_chat_template=True, max_len=22)
    assert loaded.samples == [Completion(prompt=b("[user]h\n[assistant]"), response=[121, 111, EOS])]
    assert (loaded.dropped, loaded.truncated) == (1, 1)


# --------------------------------------------------------------------------------------------------------------
# Tokenizers that merge across the prompt/response boundary


def merging_tokenizer() -> Any:
    """Byte-level BPE whose only merge is " a": "Q: " ends in a lone space, "Q: ab" merges it into " a"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: index for index, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["\u0120a"] = len(vocab)  # "Ġa" is " a"
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("\u0120", "a")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def test_sft_split_follows_openrlhf_where_tokens_merge_across_the_boundary(tmp_path: Path) -> None:
    tok = merging_tokenizer()
    v = tok.get_vocab()
    q, colon, space, space_a, b_, eos = v["Q"], v[":"], v["\u0120"], v["\u0120a"], v["b"], v["<eos>"]
    assert tok("Q: ", add_special_tokens=False)["input_ids"] == [q, colon, space]  # the prompt alone: 3 ids
    loaded = sft(write_jsonl(tmp_path, [{"input": "Q: ", "output": "ab"}]), tok)
    # Whole text "Q: ab <eos>" is [Q, :, " a", b, " ", <eos>]; OpenRLHF masks its first 3 ids.
    assert loaded.samples == [Completion(prompt=[q, colon, space_a], response=[b_, space, eos])]


def test_pairs_prompt_stops_where_chosen_and_rejected_ids_part(tmp_path: Path) -> None:
    tok = merging_tokenizer()
    v = tok.get_vocab()
    q, colon, space, space_a, eos = v["Q"], v[":"], v["\u0120"], v["\u0120a"], v["<eos>"]
    path = write_jsonl(tmp_path, [{"prompt": "Q: ", "chosen": "ab", "rejected": "cd"}])
    loaded = pairs(path, tok)
    # chosen "Q: ab <eos>" = [Q, :, " a", b, " ", <eos>]; rejected "Q: cd <eos>" = [Q, :, " ", c, d, " ", <eos>]
    assert loaded.samples == [
        Preference(prompt=[q, colon], chosen=[space_a, v["b"], space, eos], rejected=[space, v["c"], v["d"], space, eos])
    ]


# --------------------------------------------------------------------------------------------------------------
# Preference pairs


def test_pairs_plain_text_with_prompt_key_and_template(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{"prompt": "hi", "chosen": "a", "rejected": "bc\n"}])
    loaded = pairs(path, input_template="Q:{}|")
    assert loaded.samples == [
        Preference(prompt=b("Q:hi|"), chosen=[97, SPACE, EOS], rejected=[98, 99, SPACE, EOS], margin=0.0)
    ]


def test_pairs_without_prompt_key_have_an_empty_prompt(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{"chosen": "a", "rejected": "b"}])
    loaded = pairs(path, prompt_key=None, input_template="Q:{}|")  # the template needs a prompt: unused
    assert loaded.samples == [Preference(prompt=[], chosen=[97, SPACE, EOS], rejected=[98, SPACE, EOS])]


def test_dpo_drops_long_prompts_and_cuts_answers(tmp_path: Path) -> None:
    records = [
        {"prompt": "ab", "chosen": "x", "rejected": "y"},  # 2 >= 4 - 2: dropped
        {"prompt": "a", "chosen": "xyz", "rejected": "r"},  # "axyz <eos>" = 6 > 4: cut; "ar <eos>" = 4: whole
    ]
    loaded = pairs(write_jsonl(tmp_path, records), max_len=4, task="dpo")
    assert loaded.samples == [Preference(prompt=[97], chosen=[120, 121, EOS], rejected=[114, SPACE, EOS])]
    assert (loaded.dropped, loaded.truncated) == (1, 1)


def test_reward_model_keeps_long_prompts_and_reads_margins(tmp_path: Path) -> None:
    records = [
        {"prompt": "ab", "chosen": "c", "rejected": "d", "margin": 1.5},  # "abc <eos>" = 5 > 4: cut
        {"prompt": "abcdef", "chosen": "x", "rejected": "y", "margin": None},  # both cut to [a, b, c, EOS]
        {"prompt": "a", "chosen": "x", "rejected": "y", "margin": 2},
    ]
    loaded = pairs(write_jsonl(tmp_path, records), max_len=4, task="reward_model")
    assert loaded.samples == [
        Preference(prompt=[97, 98], chosen=[99, EOS], rejected=[100, EOS], margin=1.5),
        # the prompt fills max_len: each answer keeps its EOS (the reward is read there)
        Preference(prompt=[97, 98, 99], chosen=[EOS], rejected=[EOS], margin=0.0),
        Preference(prompt=[97], chosen=[120, SPACE, EOS], rejected=[121, SPACE, EOS], margin=2.0),
    ]
    assert (loaded.dropped, loaded.truncated) == (0, 2)


def test_dpo_ignores_margins(tmp_path: Path) -> None:
    loaded = pairs(write_jsonl(tmp_path, [{"prompt": "a", "chosen": "x", "rejected": "y", "margin": "big"}]))
    assert loaded.samples[0].margin == 0.0


def test_reward_model_margin_must_be_a_number(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{"prompt": "a", "chosen": "x", "rejected": "y", "margin": "big"}])
    with pytest.raises(DataError, match=r"record 0 has 'margin' = 'big' \(str\); a margin must be a number"):
        pairs(path, task="reward_model")


def test_pairs_chat_with_prompt_key(tmp_path: Path) -> None:
    record = {"prompt": [user("hi")], "chosen": [assistant("a")], "rejected": "b"}  # a string is one assistant turn
    loaded = pairs(write_jsonl(tmp_path, [record]), apply_chat_template=True, input_template="unused {}")
    assert loaded.samples == [
        Preference(prompt=b("[user]hi\n[assistant]"), chosen=[97, SPACE, EOS], rejected=[98, SPACE, EOS])
    ]


def test_pairs_chat_without_prompt_key_dpo_splits_at_the_shared_turns(tmp_path: Path) -> None:
    record = {"chosen": [user("hi"), assistant("a")], "rejected": [user("hi"), assistant("bc")]}
    loaded = pairs(write_jsonl(tmp_path, [record]), prompt_key=None, apply_chat_template=True, task="dpo")
    assert loaded.samples == [
        Preference(prompt=b("[user]hi\n[assistant]"), chosen=[97, SPACE, EOS], rejected=[98, 99, SPACE, EOS])
    ]


def test_pairs_chat_without_prompt_key_reward_model_has_empty_prompt(tmp_path: Path) -> None:
    record = {"chosen": [user("hi"), assistant("a")], "rejected": [user("ho"), assistant("b")]}
    loaded = pairs(write_jsonl(tmp_path, [record]), prompt_key=None, apply_chat_template=True, task="reward_model")
    assert loaded.samples == [
        Preference(
            prompt=[],
            chosen=b("[user]hi\n[assistant]a") + [SPACE, EOS],
            rejected=b("[user]ho\n[assistant]b") + [SPACE, EOS],
        )
    ]


def test_dpo_chat_rejected_with_another_prompt_is_an_error(tmp_path: Path) -> None:
    record = {"chosen": [user("hi"), assistant("a")], "rejected": [user("ho"), assistant("b")]}
    with pytest.raises(DataError, match=r"not the beginning of the rendered rejected conversation"):
        pairs(write_jsonl(tmp_path, [record]), prompt_key=None, apply_chat_template=True, task="dpo")


# --------------------------------------------------------------------------------------------------------------
# File formats


def test_parquet_file(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"input": ["a", "b"], "output": ["x", "y"]}), path)
    loaded = sft(str(path))
    assert loaded.samples == [
        Completion(prompt=[97], response=[120, SPACE, EOS]),
        Completion(prompt=[98], response=[121, SPACE, EOS]),
    ]


def test_saved_dataset_directory_with_messages(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    record = {"chosen": [user("hi"), assistant("a")], "rejected": [user("hi"), assistant("b")]}
    datasets.Dataset.from_list([record]).save_to_disk(str(tmp_path / "saved"))
    loaded = pairs(str(tmp_path / "saved"), prompt_key=None, apply_chat_template=True)
    assert loaded.samples == [
        Preference(prompt=b("[user]hi\n[assistant]"), chosen=[97, SPACE, EOS], rejected=[98, SPACE, EOS])
    ]


# --------------------------------------------------------------------------------------------------------------
# Errors


def test_missing_input_key_names_present_keys_and_flag(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{"inputs": "a", "output": "b"}])
    with pytest.raises(DataError) as raised:
        sft(path)
    message = str(raised.value)
    assert f"{path}: record 0 has no input_key 'input'" in message
    assert "keys present: ['inputs', 'output']" in message
    assert "Did you mean 'inputs'?" in message and "--input_key" in message


def test_missing_output_key(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{"input": "a", "output": "b"}, {"input": "a", "answer": "b"}])
    with pytest.raises(DataError, match=r"record 1 has no output_key 'output'; keys present: \['input', 'answer'\]"):
        sft(path)


@pytest.mark.parametrize("missing", ["prompt", "chosen", "rejected"])
def test_missing_pair_keys(tmp_path: Path, missing: str) -> None:
    record = {"prompt": "p", "chosen": "c", "rejected": "r"}
    del record[missing]
    with pytest.raises(DataError, match=rf"record 0 has no {missing}_key '{missing}'.*Set --{missing}_key"):
        pairs(write_jsonl(tmp_path, [record]))


def test_message_list_without_chat_template_suggests_the_flag(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{"input": [user("hi")], "output": "b"}])
    with pytest.raises(DataError, match=r"it must be a string\. It looks like chat messages: pass --apply_chat_template"):
        sft(path)


def test_number_value_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"record 0 has 'chosen' = '5' \(int\); without --apply_chat_template"):
        pairs(write_jsonl(tmp_path, [{"prompt": "p", "chosen": 5, "rejected": "r"}]))


@pytest.mark.parametrize("value", [5, ["a", "b"], []])
def test_non_messages_with_chat_template_are_an_error(tmp_path: Path, value: Any) -> None:
    path = write_jsonl(tmp_path, [{"input": value, "output": "b"}])
    with pytest.raises(DataError, match=r"record 0 has 'input' = .*with --apply_chat_template it must be a list of"):
        sft(path, apply_chat_template=True)


def test_whole_conversation_must_be_messages_not_a_string(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{"input": "hi"}])
    with pytest.raises(DataError, match=r"must be a list of \{\"role\": \.\.\., \"content\": \.\.\.\} messages\.$"):
        sft(path, apply_chat_template=True, output_key=None)


def test_message_without_role_is_an_error(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{"input": [{"content": "hi"}], "output": "b"}])
    with pytest.raises(DataError, match=r"'input' whose message 0 is .*each message needs a string \"role\""):
        sft(path, apply_chat_template=True)


def test_chat_template_requested_without_one(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{"input": "a", "output": "b"}])
    with pytest.raises(DataError, match=r"tokenizer has no chat_template; pass one with --tokenizer_chat_template"):
        sft(path, tokenizer(None), apply_chat_template=True)
    with pytest.raises(DataError, match=r"tokenizer has no chat_template"):
        pairs(write_jsonl(tmp_path, [{"prompt": "p", "chosen": "c", "rejected": "r"}], "p.jsonl"),
              tokenizer(None), apply_chat_template=True)


def test_chat_template_failure_names_the_record(tmp_path: Path) -> None:
    tok = tokenizer("{{ raise_exception('roles must alternate') }}")
    path = write_jsonl(tmp_path, [{"input": "a", "output": "b"}])
    with pytest.raises(DataError, match=r"record 0: the chat template failed on .*roles must alternate"):
        sft(path, tok, apply_chat_template=True)


def test_every_record_dropped_is_an_error(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{"input": "abc", "output": "x"}, {"input": "a", "output": ""}])
    with pytest.raises(DataError) as raised:
        sft(path, max_len=5)
    message = str(raised.value)
    assert "Every one of the 2 records" in message
    assert "1 with a prompt of >= max_len - 2 = 3 tokens" in message and "1 with an empty response" in message
    assert "Raise --max_len (now 5)" in message


def test_dpo_every_record_dropped_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"Every one of the 1 records .*1 with a prompt of >= max_len - 2 = 1 tokens"):
        pairs(write_jsonl(tmp_path, [{"prompt": "a", "chosen": "x", "rejected": "y"}]), max_len=3)


def test_sft_without_output_key_or_chat_template(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, [{"input": "a"}])
    with pytest.raises(DataError, match=r"--output_key is unset and --apply_chat_template is off"):
        sft(path, output_key=None)


def test_input_template_without_placeholder(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"input_template 'Q:' has no '\{\}' placeholder"):
        sft(write_jsonl(tmp_path, [{"input": "a", "output": "b"}]), input_template="Q:")


def test_bad_records_and_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"record 1 is '\[1, 2\]' \(list\); each record must be an object"):
        sft(write_jsonl(tmp_path, [{"input": "a", "output": "b"}, [1, 2]]))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"is empty; it needs at least one record"):
        sft(str(empty))
    with pytest.raises(DataError, match=r"does not exist"):
        sft(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match=r"max_samples=0 keeps no records"):
        sft(write_jsonl(tmp_path, [{"input": "a", "output": "b"}]), max_samples=0)
