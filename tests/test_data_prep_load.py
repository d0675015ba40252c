"""Loaders: ShareGPT / OpenAI / Alpaca, JSON and JSONL, HF datasets; every reject reason; accounting."""
import json

import pytest

from data_prep.conversations import load_conversations, normalize_record, RecordError


def test_sharegpt_json_with_both_role_styles(tmp_path):
    recs = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": "b", "system": "Be brief.", "conversations": [{"from": "user", "value": "q"}, {"from": "assistant", "value": "r"},
                                                             {"from": "human", "value": "q2"}]},
        {"id": "c", "conversations": [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]},
    ]
    p = tmp_path / "d.json"
    p.write_text(json.dumps(recs))
    res = load_conversations(str(p))
    assert res.num_input == 3 and not res.rejects
    assert res.kept[0] == {"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    assert [m["role"] for m in res.kept[1]["messages"]] == ["system", "user", "assistant", "user"]
    assert res.kept[2]["messages"][0] == {"role": "system", "content": "S"}


def test_openai_and_alpaca_jsonl_and_system_prompt(tmp_path):
    lines = [
        {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]},
        {"instruction": "Translate", "input": "bonjour", "output": "hello"},
        {"instruction": "Say hi", "input": "", "output": ""},  # no answer: the target will write it
    ]
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    res = load_conversations(str(p), system_prompt="SYS")
    assert res.num_input == 3 and len(res.kept) == 3
    assert res.kept[0]["id"] == "d-0"  # ids default to file stem + index
    assert res.kept[1]["messages"] == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "Translate\n\nbonjour"},
                                       {"role": "assistant", "content": "hello"}]
    assert res.kept[2]["messages"][-1] == {"role": "user", "content": "Say hi"}


@pytest.mark.parametrize(
    "record,reason",
    [
        ({"id": "x", "conversations": []}, "empty conversation"),
        ({"id": "x", "conversations": [{"from": "human", "value": "  "}]}, "empty content"),
        ({"id": "x", "conversations": [{"from": "human", "value": "a"}, {"from": "observation", "value": "b"}]}, "unknown role"),
        ({"id": "x", "conversations": [{"from": "system", "value": "s"}]}, "no user turn"),
        ({"id": "x", "conversations": [{"from": "human", "value": ["a"]}]}, "non-string content"),
        ({"id": "x", "conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "b"}]}, "bad turn order"),
        ({"id": "x", "conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]}, "bad turn order"),
        ({"id": "x", "conversations": "hi"}, "bad conversations"),
        ({"id": "x", "conversations": ["hi"]}, "bad turn"),
        ({"id": "x", "messages": [{"role": "tool", "content": "b"}]}, "unknown role"),
        ({"id": "x", "messages": [{"role": "user", "content": None}]}, "non-string content"),
        ({"instruction": 3, "output": "b"}, "non-string content"),
        ({"prompt": "p"}, "unknown record format"),
        (["not", "a", "dict"], "not an object"),
    ],
)
def test_every_reject_reason(record, reason):
    with pytest.raises(RecordError, match=reason):
        normalize_record(record)


def test_rejects_file_accounting_bad_json_and_duplicates(tmp_path):
    good = {"id": "g", "conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}
    lines = [json.dumps(good), "{not json", json.dumps(good), json.dumps({"id": "e", "conversations": []}),
             json.dumps({"id": "h", "messages": [{"role": "user", "content": "q"}]})]
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(lines) + "\n")
    res = load_conversations(str(p))
    assert len(res.kept) + len(res.rejects) == res.num_input == 5
    reasons = [r["reason"] for r in res.rejects]
    assert reasons[0].startswith("bad JSON line 2") and reasons[1].startswith("duplicate id") and reasons[2].startswith("empty")
    rep = res.report(str(p))
    assert rep["kept"] == 2 and rep["rejected"] == 3 and rep["reject_reasons"]["duplicate id"] == 1


def test_max_records_and_forced_format(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps([{"instruction": f"i{k}", "output": "o"} for k in range(10)]))
    res = load_conversations(str(p), max_records=4)
    assert res.num_input == 4 and len(res.kept) == 4
    res = load_conversations(str(p), fmt="sharegpt", max_records=2)
    assert [r["reason"] for r in res.rejects] == ["missing key: 'conversations' (format sharegpt)"] * 2


def test_hf_datasets_local_parquet(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]},
                                     {"messages": [{"role": "user", "content": ""}]}])
    p = tmp_path / "d.parquet"
    ds.to_parquet(str(p))
    res = load_conversations(str(p))
    assert res.num_input == 2 and len(res.kept) == 1 and res.rejects[0]["reason"].startswith("empty content")


def test_unknown_source_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="data.source is empty"):
        load_conversations("")
    with pytest.raises(ValueError, match="does not exist"):  # a path: named, no Hub lookup
        load_conversations(str(tmp_path / "nope" / "missing-dataset-xyz"))
    with pytest.raises(ValueError, match="neither a local file nor a loadable HF dataset"):
        load_conversations("nope-org/missing-dataset-xyz")
