"""rlhf.data: sources, record shapes, data_split, the over-long rule and the collators (CPU, offline).

The tokenizer is built here: one token per character (BPE with no merges), so expected ids are
`ids("text")`, plus <pad>=0 <s>=1 </s>=2 and a small Jinja chat template.
"""
from __future__ import annotations

import json
import logging

import pytest
import torch

from rlhf.config import ConfigError, DataConfig, SFTConfig
from rlhf.config.compose import compose, to_config
from rlhf.config.validate import validate_data
from rlhf.core.hub import check_sources
from rlhf.data import (
    IGNORE_INDEX,
    ChatExample,
    DataFormatError,
    PairExample,
    PromptExample,
    Row,
    SFTExample,
    collate_pairs,
    collate_prompts,
    collate_sft,
    load_rows,
    parse_data_split,
    parse_pairs,
    parse_prompts,
    parse_sft,
    split_indices,
    take_split,
    tokenize_pairs,
    tokenize_prompts,
    tokenize_sft,
)
from rlhf.data.mix import mix_indices
from rlhf.data.stage import stage_rows

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = [chr(i) for i in range(32, 127)] + ["\n"]
VOCAB = {t: i for i, t in enumerate(SPECIALS + CHARS)}
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def ids(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


def make_tokenizer(chat_template: str | None = TEMPLATE, bos: bool = True):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab=dict(VOCAB), merges=[], unk_token="<unk>")),
        pad_token="<pad>", eos_token="</s>", unk_token="<unk>", **({"bos_token": "<s>"} if bos else {}),
    )
    tok.chat_template = chat_template
    return tok


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def rows(*dicts):
    return [Row(d, f"f.jsonl:{i + 1}") for i, d in enumerate(dicts)]


# --------------------------------------------------------------------------- tokenizer sanity


def test_test_tokenizer_is_char_level(tok):
    assert tok("ab <s>\n", add_special_tokens=False)["input_ids"] == ids("ab ") + [BOS] + ids("\n")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD, BOS, EOS)


# --------------------------------------------------------------------------- SFT shapes


def test_sft_prompt_response(tok):
    [ex] = parse_sft(rows({"prompt": "Q:", "response": " A", "extra": 1}))
    assert ex == SFTExample("Q:", " A", "f.jsonl:1")
    [f], stats = tokenize_sft([ex], tok, max_len=16, max_prompt_len=8)
    assert f["input_ids"] == [BOS] + ids("Q:") + ids(" A") + [EOS]
    supervised = [(i, t) for i, t in enumerate(f["labels"]) if t != IGNORE_INDEX]
    assert supervised == [(3, VOCAB[" "]), (4, VOCAB["A"]), (5, EOS)]
    assert stats == dict(rows=1, kept=1, prompt_truncated=0, response_truncated=0, dropped=0)


def test_sft_text_has_loss_on_every_token(tok):
    [ex] = parse_sft(rows({"text": "hello"}))
    assert (ex.prompt, ex.response) == ("", "hello")
    [f], _ = tokenize_sft([ex], tok, 16, 8)
    assert f["input_ids"] == [BOS] + ids("hello") + [EOS]
    assert f["labels"] == [IGNORE_INDEX] + ids("hello") + [EOS]
    [f], _ = tokenize_sft([ex], tok, 16, 8, add_bos=False)
    assert f["labels"] == f["input_ids"] == ids("hello") + [EOS]


def test_sft_messages_rendered_with_chat_template(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    [ex] = parse_sft(rows({"messages": msgs}), tok)
    assert ex == ChatExample(msgs, "f.jsonl:1")  # the whole conversation: every assistant turn is trained
    [f], stats = tokenize_sft([ex], tok, 64, 48)
    assert stats["prompt_truncated"] == 0
    prompt = "<|system|>S\n<|user|>hi\n<|assistant|>"
    assert f["input_ids"] == [BOS] + ids(prompt + "yo\n")  # the template's rendering, nothing appended
    n = 1 + len(prompt)
    # (issue #29) the turn as the template writes it, its end ("\n" here) included; no tokenizer eos
    assert [(i, t) for i, t in enumerate(f["labels"]) if t != IGNORE_INDEX] == [(n, VOCAB["y"]), (n + 1, VOCAB["o"]),
                                                                               (n + 2, VOCAB["\n"])]


def test_sft_messages_errors(tok):
    user_last = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    with pytest.raises(DataFormatError, match=r"f\.jsonl:1: field 'messages': last message has role 'user'"):
        parse_sft(rows(user_last), tok)
    ok = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    with pytest.raises(DataFormatError, match="no tokenizer"):
        parse_sft(rows(ok))
    with pytest.raises(DataFormatError, match="no chat_template"):
        parse_sft(rows(ok), make_tokenizer(chat_template=None))
    bad = {"messages": [{"role": "user"}, {"role": "assistant", "content": "b"}]}
    with pytest.raises(DataFormatError, match=r"'messages'\[0\] is not a \{role: str, content: str\}"):
        parse_sft(rows(bad), tok)


def test_sft_prompt_may_be_a_message_list(tok):
    [ex] = parse_sft(rows({"prompt": [{"role": "user", "content": "hi"}], "response": "yo"}), tok)
    assert (ex.prompt, ex.response) == ("<|user|>hi\n<|assistant|>", "yo")


def test_sft_from_pair_shapes_takes_the_chosen_response(tok):
    # one preference dataset split between the three stages: SFT trains on prompt + chosen
    out = parse_sft(rows({"prompt": "Q:", "chosen": " yes", "rejected": " no"}, {"prompt": "R:", "chosen": " a", "rejected": " b"}))
    assert [(e.prompt, e.response) for e in out] == [("Q:", " yes"), ("R:", " a")]
    hh = parse_sft(rows({"chosen": "\n\nHuman: hi\n\nAssistant: good", "rejected": "\n\nHuman: hi\n\nAssistant: bad"}))
    assert (hh[0].prompt, hh[0].response) == ("\n\nHuman: hi\n\nAssistant:", " good")
    feats, _ = tokenize_sft(out[:1], tok, max_len=16, max_prompt_len=8)
    assert feats[0]["labels"] == [IGNORE_INDEX] * 3 + ids(" yes") + [EOS]


def test_sft_row_that_fits_no_shape_lists_accepted_shapes():
    with pytest.raises(DataFormatError) as e:
        parse_sft(rows({"question": "q", "answer": "a"}))
    msg = str(e.value)
    assert "f.jsonl:1" in msg and "['answer', 'question']" in msg
    assert "{prompt, response}" in msg and "{text}" in msg and "{messages" in msg


def test_sft_rows_must_all_fit_the_detected_shape():
    with pytest.raises(DataFormatError, match=r"f\.jsonl:2: field 'response' must be a string, got int"):
        parse_sft(rows({"prompt": "a", "response": "b"}, {"prompt": "a", "response": 3}))


def test_plain_dicts_get_row_index_origins():
    assert parse_sft([{"text": "a"}, {"text": "b"}])[1].origin == "row 1"


# --------------------------------------------------------------------------- pair shapes


def test_pairs_prompt_chosen_rejected():
    [ex] = parse_pairs(rows({"prompt": "\n\nHuman: hi\n\nAssistant:", "chosen": " good", "rejected": " bad", "response": " good"}))
    assert ex == PairExample("\n\nHuman: hi\n\nAssistant:", " good", " bad", "f.jsonl:1")


def test_pairs_hh_multi_turn():
    shared = "\n\nHuman: 2+2?\n\nAssistant: 4\n\nHuman: and 3+3?\n\nAssistant:"
    [ex] = parse_pairs(rows({"chosen": shared + " 6", "rejected": shared + " 7, I think"}))
    assert (ex.prompt, ex.chosen, ex.rejected) == (shared, " 6", " 7, I think")
    [p] = parse_prompts(rows({"chosen": shared + " 6", "rejected": shared + " 7"}))
    assert p.prompt == shared


def test_ultrafeedback_binarized_rows_are_pairs_of_conversations(tmp_path, tok):
    """HuggingFaceH4/ultrafeedback_binarized's shape: a `prompt` string beside `chosen`/`rejected` message
    lists (and `messages`, scores, ids): the pair is the shared conversation + each final answer."""
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    row = {"prompt": "What is 2+2?", "prompt_id": "a1", "score_chosen": 8.0, "score_rejected": 3.0,
           "chosen": conv + [{"role": "assistant", "content": "4"}],
           "rejected": conv + [{"role": "assistant", "content": "5, I think"}],
           "messages": conv + [{"role": "assistant", "content": "4"}]}
    path = tmp_path / "uf.jsonl"
    path.write_text(json.dumps(row) + "\n")
    [ex] = parse_pairs(load_rows(str(path)), tok)
    assert ex.prompt == tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert (ex.chosen.strip(), ex.rejected.strip()) == ("4", "5, I think") and ex.origin.endswith("uf.jsonl:1")


def test_pairs_hh_differing_prefixes_is_an_error():
    with pytest.raises(DataFormatError, match=r"f\.jsonl:2: 'chosen' and 'rejected' differ before their last"):
        parse_pairs(rows(
            {"chosen": "\n\nHuman: a\n\nAssistant: x", "rejected": "\n\nHuman: a\n\nAssistant: y"},
            {"chosen": "\n\nHuman: a\n\nAssistant: x", "rejected": "\n\nHuman: b\n\nAssistant: y"},
        ))
    with pytest.raises(DataFormatError, match=r"'rejected' has no '\\n\\nAssistant:' turn"):
        parse_pairs(rows({"chosen": "\n\nHuman: a\n\nAssistant: x", "rejected": "plain"}))


def test_pairs_message_lists(tok):
    prefix = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"}, {"role": "user", "content": "2+2?"}]
    row = {"prompt": "ignored raw text", "chosen": prefix + [{"role": "assistant", "content": "4"}],
           "rejected": prefix + [{"role": "assistant", "content": "5"}]}
    [ex] = parse_pairs(rows(row), tok)
    assert ex.prompt == "<|user|>hi\n<|assistant|>hey\n<|user|>2+2?\n<|assistant|>"
    assert (ex.chosen, ex.rejected) == ("4", "5")
    other = dict(row, rejected=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "5"}])
    with pytest.raises(DataFormatError, match="conversations differ before their last message"):
        parse_pairs(rows(other), tok)


def test_pairs_prompt_as_message_list(tok):
    row = {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"}
    [ex] = parse_pairs(rows(row), tok)
    assert (ex.prompt, ex.chosen, ex.rejected) == ("<|user|>hi\n<|assistant|>", "a", "b")


def test_pairs_bad_row_names_field_and_shapes():
    with pytest.raises(DataFormatError) as e:
        parse_pairs(rows({"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "p", "chosen": "a"}))
    msg = str(e.value)
    assert "f.jsonl:2" in msg and "missing field 'rejected'" in msg and "hh-rlhf" in msg


# --------------------------------------------------------------------------- prompt shapes


def test_prompts_keep_answer_and_meta(tok):
    got = parse_prompts(rows(
        {"prompt": "Human: What is 1+2?\n\nAssistant:", "answer": "3", "task": "add"},
        {"prompt": "p2", "answer": None, "task": "sort", "chosen": "long text not in meta"},
    ))
    assert got[0] == PromptExample("Human: What is 1+2?\n\nAssistant:", "f.jsonl:1", "3", {"task": "add"})
    assert got[1] == PromptExample("p2", "f.jsonl:2", None, {"task": "sort"})


def test_prompts_from_messages_drop_a_final_assistant_turn(tok):
    done = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    open_ = {"messages": [{"role": "user", "content": "q"}]}
    assert [p.prompt for p in parse_prompts(rows(done, open_), tok)] == ["<|user|>q\n<|assistant|>"] * 2


def test_prompts_reject_text_rows():
    with pytest.raises(DataFormatError, match=r"fit no prompt shape.*\{prompt\}"):
        parse_prompts(rows({"text": "t"}))


# --------------------------------------------------------------------------- sources

ROWS = [{"prompt": "p1", "response": "r1", "answer": "a"}, {"prompt": "p2", "response": "r2", "answer": None}]


def _write_jsonl(path, dicts, blank_at=None):
    lines = [json.dumps(d) for d in dicts]
    if blank_at is not None:
        lines.insert(blank_at, "   ")
    path.write_text("\n".join(lines) + "\n")


def test_sources_load_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    _write_jsonl(tmp_path / "a.jsonl", ROWS, blank_at=1)
    (tmp_path / "a.json").write_text(json.dumps(ROWS))
    (tmp_path / "b.json").write_text(json.dumps({"data": ROWS}))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "a.parquet")
    (tmp_path / "dir").mkdir()
    _write_jsonl(tmp_path / "dir" / "train.jsonl", ROWS)
    (tmp_path / "pqdir").mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "pqdir" / "train.parquet")

    jsonl = load_rows(str(tmp_path / "a.jsonl"))
    assert [r.origin for r in jsonl] == [f"{tmp_path}/a.jsonl:1", f"{tmp_path}/a.jsonl:3"]  # blank line 2 skipped
    assert [r.data for r in jsonl] == [ROWS[0], {"prompt": "p2", "response": "r2", "answer": None}]
    for name in ("a.json", "b.json", "a.parquet"):
        assert [r.data for r in load_rows(str(tmp_path / name))] == ROWS, name
    assert load_rows(str(tmp_path / "a.parquet"))[1].origin == f"{tmp_path}/a.parquet row 1"
    for name in ("dir", "pqdir"):
        got = load_rows(str(tmp_path / name), split="train", cache_dir=str(tmp_path / "cache"))
        assert [r.data for r in got] == ROWS, name
        assert got[1].origin == f"dataset {tmp_path}/{name} row 1"
    # and they parse the same way
    assert [(e.prompt, e.response) for e in parse_sft(jsonl)] == [("p1", "r1"), ("p2", "r2")]


def test_malformed_jsonl_bad_json_names_file_and_line(tmp_path):
    f = tmp_path / "file.jsonl"
    f.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": "d"}\n{"prompt": oops}\n')
    with pytest.raises(DataFormatError, match=r"file\.jsonl:3: invalid JSON: Expecting value"):
        load_rows(str(f))
    f.write_text('{"prompt": "a", "response": "b"}\n[1, 2]\n')
    with pytest.raises(DataFormatError, match=r"file\.jsonl:2: expected a JSON object per line, got list"):
        load_rows(str(f))


def test_malformed_jsonl_missing_field_names_line_field_and_shapes(tmp_path):
    f = tmp_path / "file.jsonl"
    f.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c"}\n')
    with pytest.raises(DataFormatError) as e:
        parse_sft(load_rows(str(f)))
    msg = str(e.value)
    assert f"{f}:2" in msg and "missing field 'response'" in msg
    assert "Accepted SFT shapes: {prompt, response}" in msg and "{text}" in msg and "{messages" in msg


def test_missing_file_and_unknown_extension(tmp_path):
    with pytest.raises(FileNotFoundError, match="data file not found: .*nope.jsonl"):
        load_rows(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataFormatError, match="data file not found"):
        load_rows(str(tmp_path / "nope.parquet"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataFormatError, match=r"unsupported file type '\.csv'; supported: \.jsonl, \.json, \.parquet"):
        load_rows(str(tmp_path / "x.csv"))
    with pytest.raises(DataFormatError, match=r"unsupported file type '\.txt'"):
        load_rows(str(tmp_path / "missing.txt"))
    with pytest.raises(FileNotFoundError, match="data path not found"):
        load_rows(str(tmp_path / "no_such_dir"))


def test_a_directory_without_data_files_says_what_it_holds(tmp_path):
    """datasets.load_dataset(dir) reads .txt files as one-column text rows, which then failed as "global_batch_size
    exceeds the 1 training rows" (#29): a directory must hold .jsonl, .json or .parquet files."""
    d = tmp_path / "txt"
    d.mkdir()
    for name in ("b.txt", "a.txt", "README.md"):
        (d / name).write_text("Human: hi\n")
    with pytest.raises(DataFormatError) as e:
        load_rows(str(d))
    assert str(e.value) == (f"{d}: no .jsonl, .json or .parquet file in this directory (it holds README.md, a.txt, "
                            "b.txt): name a data file, or a directory of them")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataFormatError, match=r"empty: no \.jsonl, \.json or \.parquet file in this directory \(it is empty"):
        load_rows(str(empty))
    many = tmp_path / "many"
    many.mkdir()
    for i in range(12):
        (many / f"{i:02d}.txt").write_text("x")
    with pytest.raises(DataFormatError, match=r"\(it holds 00\.txt, 01\.txt, .*, 07\.txt and 4 more\)"):
        load_rows(str(many))


def test_json_must_be_a_list_of_objects(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"a": 1, "b": 2}))
    with pytest.raises(DataFormatError, match="expected a list of objects"):
        load_rows(str(tmp_path / "a.json"))
    (tmp_path / "b.json").write_text(json.dumps([{"text": "x"}, "y"]))
    with pytest.raises(DataFormatError, match=r"b\.json row 1: expected an object, got str"):
        load_rows(str(tmp_path / "b.json"))


# --------------------------------------------------------------------------- mixtures (data.path=[a,b])


def _mix_files(tmp_path):
    a = tmp_path / "a.jsonl"
    _write_jsonl(a, [{"prompt": f"p{i}", "response": f" r{i}"} for i in range(100)])
    b = tmp_path / "b.jsonl"  # another shape: each source's is detected on its own
    _write_jsonl(b, [{"instruction": f"i{i}", "output": f"o{i}"} for i in range(20)])
    return str(a), str(b)


def _mix(paths, **kw):
    return stage_rows(DataConfig(path=paths, **kw), stage=0)


def test_mixture_counts_per_source(tmp_path, caplog):
    a, b = _mix_files(tmp_path)
    with caplog.at_level(logging.INFO, logger="rlhf.data.mix"):
        train, held = _mix([a, b], weights=[0.7, 0.3], eval_fraction=0.1)
    # each source's held-out tenth first (10 + 2 rows), then 90 + 18 = 108 training rows shared 0.7 / 0.3
    assert sorted(r.origin for r in held) == sorted({r.origin for r in held}) and len(held) == 12
    from_a = [r.origin for r in train if r.dataset == a]
    from_b = [r.origin for r in train if r.dataset == b]
    assert (len(from_a), len(from_b)) == (76, 32)  # round(75.6), round(32.4)
    assert len(set(from_a)) == 76  # enough rows: drawn without replacement
    assert len(set(from_b)) == 18  # 18 rows for 32: each once or twice
    assert not {r.origin for r in held} & {r.origin for r in train}  # no held-out row trains
    assert "2 sources mixed by data.weights=[0.7, 0.3] into 108 training rows" in caplog.text
    assert f"{a}: 76 of its 90 rows" in caplog.text and f"{b}: 32 of its 18 rows, repeated: each row 1 or 2" in caplog.text
    examples = parse_sft(train)
    assert {type(e) for e in examples} == {SFTExample}
    assert {e.prompt[0] for e in examples} == {"p", "i"}
    # data.mix_size sets the total; no weights: by the sources' sizes; a string path is one source as before
    train, _ = _mix([a, b], eval_fraction=0.0, mix_size=60)
    assert (sum(r.dataset == a for r in train), sum(r.dataset == b for r in train)) == (50, 10)
    train, _ = _mix([a, b], eval_fraction=0.0)
    assert [r.origin for r in train] == [r.origin for r in load_rows(a) + load_rows(b)]  # every row once
    assert [r.origin for r in _mix(a)[0]] == [r.origin for r in _mix([a])[0]]


def test_mixture_is_deterministic(tmp_path):
    a, b = _mix_files(tmp_path)
    kw = dict(weights=[0.5, 0.5], eval_fraction=0.05, data_split="1,1,1")
    first, again = _mix([a, b], **kw), _mix([a, b], **kw)
    assert [[r.origin for r in part] for part in first] == [[r.origin for r in part] for part in again]
    other = _mix([a, b], **kw, split_seed=7)
    assert [r.origin for r in other[0]] != [r.origin for r in first[0]]


@pytest.mark.parametrize("weights,says", [
    ([0.7], r"data\.weights needs one weight per data\.path source \(2\), got 1"),
    ([0.7, -0.3], r"data\.weights must be finite and >= 0"),
    ([0.0, 0.0], r"data\.weights must not all be zero"),
    ([float("nan"), 1.0], r"data\.weights must be finite"),
])
def test_bad_mixture_weights_are_refused(tmp_path, weights, says):
    a, b = _mix_files(tmp_path)
    with pytest.raises(ConfigError, match=says):
        validate_data(DataConfig(path=[a, b], weights=weights))
    with pytest.raises(ConfigError, match=says):
        _mix([a, b], weights=weights)
    with pytest.raises(ConfigError, match=r"data\.path must be a file, a directory or a datasets hub name, or a list"):
        validate_data(DataConfig(path=[a, ""]))
    with pytest.raises(ConfigError, match=r"data\.mix_size must be null"):
        validate_data(DataConfig(path=[a, b], mix_size=0))
    with pytest.raises(ConfigError, match=r"data\.path source 'b\.jsonl' has no training rows .* to draw its 3 from"):
        mix_indices([5, 0], [0.5, 0.5], None, 0, ["a.jsonl", "b.jsonl"])


def test_mixture_from_the_command_line_and_hub_names_in_it():
    cfg = to_config(compose("sft", ["data.path=[a.jsonl,b.jsonl]", "data.weights=[0.7,0.3]"]), SFTConfig)
    assert (cfg.data.path, cfg.data.weights) == (["a.jsonl", "b.jsonl"], [0.7, 0.3])
    check_sources(cfg)  # local file names: nothing to look up
    cfg.data.path = ["a.jsonl", "some-org/some-dataset"]  # the hub does not answer here (conftest)
    with pytest.raises(ConfigError, match=r"data\.path='some-org/some-dataset' is not a local path"):
        check_sources(cfg)


# --------------------------------------------------------------------------- data_split


@pytest.mark.parametrize("n", [0, 1, 7, 10, 101, 1000])
def test_split_indices_disjoint_covering_proportional(n):
    parts = [split_indices(n, "2,4,4", s, seed=1234) for s in range(3)]
    assert parts == [split_indices(n, "2,4,4", s, seed=1234) for s in range(3)]  # deterministic
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(n)) and len(set(flat)) == n
    for p, share in zip(parts, (0.2, 0.4, 0.4)):
        assert abs(len(p) - share * n) <= 1


def test_split_indices_exact_and_seeded():
    assert [len(split_indices(10, "2,4,4", s, 0)) for s in range(3)] == [2, 4, 4]
    assert [len(split_indices(10, [1, 1, 1], s, 0)) for s in range(3)] == [3, 4, 3]  # round(3.33), round(6.67)
    assert split_indices(5, "1,0,0", 0, 7) == __import__("numpy").random.RandomState(7).permutation(5).tolist()
    assert split_indices(5, "1,0,0", 1, 7) == [] and split_indices(5, "1,0,0", 2, 7) == []
    assert split_indices(100, "2,4,4", 1, seed=1) != split_indices(100, "2,4,4", 1, seed=2)
    assert take_split(list("abcde"), "0,0,1", 2, 3) == [list("abcde")[i] for i in split_indices(5, "0,0,1", 2, 3)]
    assert parse_data_split("2,4,4") == pytest.approx((0.2, 0.4, 0.4))


@pytest.mark.parametrize("bad", ["2,4", "1,2,3,4", "-1,1,1", "0,0,0", "a,b,c", "1,nan,1", ""])
def test_split_invalid_names_the_key(bad):
    with pytest.raises(ValueError, match=r"data\.data_split"):
        split_indices(10, bad, 0, 0)


def test_split_invalid_stage():
    with pytest.raises(ValueError, match="stage"):
        split_indices(10, "1,1,1", 3, 0)


# --------------------------------------------------------------------------- the over-long rule


def test_sft_prompt_cut_from_the_left_then_response_cut_on_the_right(tok):
    ex = SFTExample("abcdef", "xyz", "o")
    # max_prompt_len 4 = bos + the last 3 prompt tokens; max_len 6 leaves 2 for "xyz</s>"
    [f], stats = tokenize_sft([ex], tok, max_len=6, max_prompt_len=4)
    assert f["input_ids"] == [BOS] + ids("def") + ids("xy")
    assert f["labels"] == [IGNORE_INDEX] * 4 + ids("xy")  # no eos: the response was cut
    assert stats == dict(rows=1, kept=1, prompt_truncated=1, response_truncated=1, dropped=0)


def test_sft_exact_fit_and_eos_only_cut(tok):
    ex = SFTExample("ab", "xy", "o")
    [f], stats = tokenize_sft([ex], tok, max_len=6, max_prompt_len=3)  # 1+2+2+1 = 6 fits
    assert f["input_ids"] == [BOS] + ids("abxy") + [EOS] and stats["response_truncated"] == 0
    [f], stats = tokenize_sft([ex], tok, max_len=5, max_prompt_len=3)  # only the eos is cut
    assert f["input_ids"] == [BOS] + ids("abxy") and stats["response_truncated"] == 1


def test_sft_drop_mode_and_no_response_room(tok, caplog):
    exs = [SFTExample("ab", "x", "fits"), SFTExample("abcdef", "x", "long prompt"), SFTExample("a", "xyzw", "long resp")]
    with caplog.at_level(logging.WARNING, logger="rlhf.data.tokenize"):
        out, stats = tokenize_sft(exs, tok, max_len=5, max_prompt_len=3, overlong="drop")
    assert [f["input_ids"] for f in out] == [[BOS] + ids("abx") + [EOS]]
    assert stats == dict(rows=3, kept=1, prompt_truncated=0, response_truncated=0, dropped=2)
    assert "tokenize_sft: 3 rows -> 1 kept" in caplog.text and "dropped=2" in caplog.text
    # the prompt part fills max_len: no response token is left -> dropped even under "truncate"
    out, stats = tokenize_sft([SFTExample("abcd", "x", "o")], tok, max_len=3, max_prompt_len=3)
    assert out == [] and stats["dropped"] == 1 and stats["kept"] == 0


def test_sft_no_log_when_nothing_cut(tok, caplog):
    with caplog.at_level(logging.WARNING, logger="rlhf.data.tokenize"):
        tokenize_sft([SFTExample("a", "b", "o")], tok, 8, 4)
    assert caplog.text == ""


def test_bos_not_doubled_and_kept_on_left_cut(tok):
    [f], _ = tokenize_sft([SFTExample("<s>ab", "x", "o")], tok, max_len=8, max_prompt_len=4)
    assert f["input_ids"] == [BOS] + ids("ab") + ids("x") + [EOS]
    [f], _ = tokenize_sft([SFTExample("<s>abc", "x", "o")], tok, max_len=8, max_prompt_len=3)
    assert f["input_ids"] == [BOS] + ids("bc") + ids("x") + [EOS]
    no_bos = make_tokenizer(bos=False)
    [f], _ = tokenize_sft([SFTExample("abc", "x", "o")], no_bos, max_len=8, max_prompt_len=2)
    assert f["input_ids"] == ids("bc") + ids("x") + [EOS]


def test_bad_arguments(tok):
    with pytest.raises(ValueError, match="overlong"):
        tokenize_sft([], tok, 8, 4, overlong="cut")
    with pytest.raises(ValueError, match="max_len"):
        tokenize_sft([], tok, 4, 8)


def test_tokenize_pairs_rule(tok):
    exs = [
        PairExample("abcd", "xy", "z", "cut both"),
        PairExample("p", "same", "same", "identical text"),
        PairExample("p", "xyz1", "xyz2", "identical after cut"),
        PairExample("p", "a", "b", "fits"),
    ]
    out, stats = tokenize_pairs(exs, tok, max_len=5, max_prompt_len=3)
    assert out == [
        {"chosen_ids": [BOS] + ids("cd") + ids("xy"), "rejected_ids": [BOS] + ids("cd") + ids("z") + [EOS], "prompt_len": 3, "index": 0},
        {"chosen_ids": [BOS] + ids("pa") + [EOS], "rejected_ids": [BOS] + ids("pb") + [EOS], "prompt_len": 2, "index": 3},
    ]
    assert stats == dict(rows=4, kept=2, prompt_truncated=1, response_truncated=1, dropped=2, identical=2)
    out, stats = tokenize_pairs(exs, tok, max_len=5, max_prompt_len=3, overlong="drop")
    assert [o["prompt_len"] for o in out] == [2] and stats["dropped"] == 3 and stats["identical"] == 1


def test_tokenize_prompts_left_cut_and_metadata(tok):
    exs = [PromptExample("abcdef", "o", "42", {"task": "add"}), PromptExample("ab", "o2")]
    out, stats = tokenize_prompts(exs, tok, max_prompt_len=4)
    assert out == [
        {"input_ids": [BOS] + ids("def"), "prompt": "abcdef", "answer": "42", "meta": {"task": "add"}},
        {"input_ids": [BOS] + ids("ab"), "prompt": "ab", "answer": None, "meta": {}},
    ]
    assert stats == dict(rows=2, kept=2, prompt_truncated=1, dropped=0)
    out, stats = tokenize_prompts(exs, tok, max_prompt_len=4, overlong="drop")
    assert len(out) == 1 and stats["dropped"] == 1
    out, stats = tokenize_prompts([PromptExample("", "o")], make_tokenizer(bos=False), max_prompt_len=4)
    assert out == [] and stats["dropped"] == 1


# --------------------------------------------------------------------------- collators


def test_collate_sft_right_pads():
    batch = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    got = collate_sft(batch, pad_id=0)
    assert torch.equal(got["input_ids"], torch.tensor([[5, 6, 7], [8, 0, 0]]))
    assert torch.equal(got["attention_mask"], torch.tensor([[1, 1, 1], [1, 0, 0]]))
    assert torch.equal(got["labels"], torch.tensor([[-100, 6, 7], [8, -100, -100]]))
    assert all(t.dtype == torch.long for t in got.values())


def test_collate_pairs_chosen_rows_first():
    batch = [{"chosen_ids": [1, 2], "rejected_ids": [1, 3, 4], "prompt_len": 1},
             {"chosen_ids": [5], "rejected_ids": [5, 6], "prompt_len": 1}]
    got = collate_pairs(batch, pad_id=9)
    assert torch.equal(got["input_ids"], torch.tensor([[1, 2, 9], [5, 9, 9], [1, 3, 4], [5, 6, 9]]))
    assert torch.equal(got["attention_mask"], torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]]))


def test_collate_prompts_left_pads():
    got = collate_prompts([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}], pad_id=0)
    assert torch.equal(got["input_ids"], torch.tensor([[1, 2, 3], [0, 0, 4]]))
    assert torch.equal(got["attention_mask"], torch.tensor([[1, 1, 1], [0, 0, 1]]))


def test_end_to_end_default_task_shapes(tmp_path, tok):
    """jsonl -> split -> parse -> tokenize -> collate, as a stage app would chain them."""
    f = tmp_path / "prompts.jsonl"
    _write_jsonl(f, [{"prompt": f"Human: What is {i}+1?\n\nAssistant:", "answer": str(i + 1), "task": "add"} for i in range(10)])
    part = take_split(load_rows(str(f)), "0,0,1", stage=2, seed=0)
    feats, stats = tokenize_prompts(parse_prompts(part), tok, max_prompt_len=64)
    assert stats["kept"] == 10 and sorted(x["answer"] for x in feats) == sorted(str(i + 1) for i in range(10))
    batch = collate_prompts(feats[:2], tok.pad_token_id)
    assert batch["input_ids"].shape == (2, 1 + len("Human: What is 0+1?\n\nAssistant:"))
