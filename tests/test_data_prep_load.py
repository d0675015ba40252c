"""Loaders: ShareGPT / OpenAI / Alpaca, JSON and JSONL, HF datasets; every reject reason; accounting."""
import json

import pytest

from data_prep.conversations import load_conversations, normalize_record, record_tools, RecordError


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
        ({"id": "x", "conversations": [{"from": "human", "value": "a"}, {"from": "robot", "value": "b"}]}, "unknown role"),
        # a tool result answers an assistant's tool call: after a user turn it is out of order
        ({"id": "x", "conversations": [{"from": "human", "value": "a"}, {"from": "observation", "value": "b"}]},
         "bad turn order: turn 1: expected assistant, got tool"),
        ({"id": "x", "conversations": [{"from": "system", "value": "s"}]}, "no user turn"),
        ({"id": "x", "conversations": [{"from": "human", "value": ["a"]}]}, "non-string content"),
        ({"id": "x", "conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "b"}]}, "bad turn order"),
        ({"id": "x", "conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]}, "bad turn order"),
        ({"id": "x", "conversations": "hi"}, "bad conversations"),
        ({"id": "x", "conversations": ["hi"]}, "bad turn"),
        ({"id": "x", "messages": [{"role": "robot", "content": "b"}]}, "unknown role"),
        ({"id": "x", "messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]},
         "bad turn order: turn 1: expected assistant, got tool"),
        ({"id": "x", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}]},
         "empty content: turn 1 assistant 'content' is null and the turn has no tool_calls"),
        ({"id": "x", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None,
                                   "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
         "bad JSON: turn 1 tool call 0 arguments is a string that is not JSON"),
        ({"id": "x", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None,
                                   "tool_calls": [{"function": {"arguments": "{}"}}]}]},
         "bad tool call: turn 1 tool call 0 has no function name"),
        ({"id": "x", "messages": [{"role": "user", "content": "a"},
                                  {"role": "assistant", "content": "<think>r</think>a", "reasoning_content": "r"}]},
         "double reasoning: turn 1"),
        ({"id": "x", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>r</think>"}]},
         "empty content: turn 1 has reasoning but no answer"),
        ({"id": "x", "tools": "[{oops", "messages": [{"role": "user", "content": "a"}]}, "bad JSON: tools"),
        ({"id": "x", "tools": [{"description": "d"}], "messages": [{"role": "user", "content": "a"}]},
         "bad tools: tool 0 has no function name"),
        ({"id": "x", "messages": [{"role": "user", "content": None}]}, "non-string content"),
        ({"instruction": 3, "output": "b"}, "non-string content"),
        ({"prompt": "p"}, "unknown record format"),
        (["not", "a", "dict"], "not an object"),
    ],
)
def test_every_reject_reason(record, reason):
    with pytest.raises(RecordError, match=reason):
        normalize_record(record)
        record_tools(record)


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


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_openai_tool_calls_and_reasoning_are_kept(tmp_path):
    """content null beside tool_calls is valid; arguments given as a JSON string become an object; reasoning_content,
    `reasoning` and an inline <think> all end as reasoning_content; tool results keep their call id."""
    recs = [
        {"id": "t", "tools": TOOLS, "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "reasoning_content": "I need the tool.",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": {"sky": "sunny"}},
            {"role": "assistant", "content": "<think>\nIt said sunny.\n</think>\n\nSunny."}]},
        {"id": "r", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "reasoning": "greet", "content": "Hello"}]},
    ]
    path = tmp_path / "tools.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    res = load_conversations(str(path))
    assert res.rejects == [] and len(res.kept) == 2
    t = res.kept[0]
    assert t["tools"] == TOOLS
    call = t["messages"][1]
    assert call["content"] == "" and call["reasoning_content"] == "I need the tool."
    assert call["tool_calls"] == [{"type": "function", "id": "c1",
                                   "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert t["messages"][2] == {"role": "tool", "content": '{"sky": "sunny"}', "tool_call_id": "c1"}
    assert t["messages"][3] == {"role": "assistant", "content": "Sunny.", "reasoning_content": "It said sunny."}
    assert res.kept[1]["messages"][1] == {"role": "assistant", "content": "Hello", "reasoning_content": "greet"}
    assert "tools" not in res.kept[1]


def test_sharegpt_with_tools_as_llama_factory_and_specforge_write_it():
    """function_call / observation turns with `tools` as a JSON string (LLaMA-Factory, glaive), and role/content
    turns carrying tool_calls (SpecForge), give the same normalised conversation."""
    lf = {"id": "a", "tools": json.dumps([TOOLS[0]["function"]]), "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": "sunny"},
        {"from": "gpt", "value": "Sunny."}]}
    sf = {"id": "a", "tools": TOOLS, "conversations": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."}]}
    assert normalize_record(lf) == normalize_record(sf)
    assert record_tools(lf) == record_tools(sf) == TOOLS
    # a second call chained after the first result, then the answer
    chained = {"conversations": lf["conversations"][:3] + [lf["conversations"][1], {"from": "observation", "value": "x"},
                                                           {"from": "gpt", "value": "Done."}]}
    assert [m["role"] for m in normalize_record(chained)] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
