"""Exact assistant-only loss masks for every shipped template, both mask paths, truncation/drop counts."""
import pytest

from data_prep.chat_template import END_OF_TURN, setup_chat_template
from recipes.chat_templates import read_template, shipped_templates
from data_prep.loss_mask import TemplateMaskError, render_masked, tokenize_records, tokenize_with_mask
from test_data_prep_helpers import build_tokenizer

MESSAGES = [
    {"role": "system", "content": "Be nice."},
    {"role": "user", "content": "Hello there, how are you today?"},
    {"role": "assistant", "content": "I am fine, thank you."},
    {"role": "user", "content": "Tell me a story about a cat."},
    {"role": "assistant", "content": "Once upon a time a little cat lived in a big house."},
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(None)


def masked_runs(ids, mask):
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def without_markers(template: str) -> str:
    return template.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")


def test_all_templates_shipped():
    assert {"llama-2-chat", "llama-3", "vicuna", "chatml"} <= set(shipped_templates())


@pytest.mark.parametrize("name", ["llama-2-chat", "llama-3", "vicuna", "chatml", "plain"])
@pytest.mark.parametrize("mode", ["generation", "prefix"])
def test_masked_tokens_are_exactly_replies_plus_end_of_turn(tok, name, mode):
    template = read_template(name)
    assert "{%- generation -%}" in template
    tok.chat_template = template if mode == "generation" else without_markers(template)
    ids, mask = tokenize_with_mask(tok, MESSAGES, mode=mode)
    assert ids == tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=True)["input_ids"]
    eot = END_OF_TURN.get(name, tok.eos_token)
    replies = [m["content"] for m in MESSAGES if m["role"] == "assistant"]
    runs = masked_runs(ids, mask)
    assert len(runs) == len(replies)
    for run, reply in zip(runs, replies):
        text = tok.decode(run, skip_special_tokens=False)
        assert text.endswith(eot), (name, text)
        assert text[: -len(eot)].strip() == reply, (name, text)
    # nothing else is trained on: every user/system text is outside the mask
    unmasked = tok.decode([t for t, m in zip(ids, mask) if not m])
    for m in MESSAGES:
        if m["role"] != "assistant":
            assert m["content"] in unmasked


@pytest.mark.parametrize("name", ["llama-2-chat", "llama-3", "vicuna", "chatml", "plain"])
def test_generation_markers_and_prefix_templating_agree(tok, name):
    tok.chat_template = read_template(name)
    a = tokenize_with_mask(tok, MESSAGES, mode="generation")
    tok.chat_template = without_markers(read_template(name))
    b = tokenize_with_mask(tok, MESSAGES, mode="prefix")
    assert a == b


def test_non_prefix_stable_template_is_refused(tok):
    # a template that renders the LAST assistant turn differently is not prefix-stable
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                         "{% if loop.last %}!{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(TemplateMaskError, match="not prefix-stable"):
        tokenize_with_mask(tok, MESSAGES[1:], mode="prefix")


def test_missing_template_is_a_clear_error():
    tok = build_tokenizer(None)
    with pytest.raises(ValueError, match="no chat template.*target.chat_template"):
        setup_chat_template(tok, None)
    with pytest.raises(ValueError, match="unknown chat template"):
        setup_chat_template(tok, "nope")
    assert setup_chat_template(tok, "vicuna") == "vicuna" and "USER:" in tok.chat_template


def test_truncate_and_drop_are_counted(tok):
    tok.chat_template = read_template("chatml")
    recs = [{"id": "short", "messages": MESSAGES[1:3]}, {"id": "long", "messages": MESSAGES[1:]},
            {"id": "lim", "messages": MESSAGES[1:3], "length_limited": True}]
    n_short = len(tokenize_with_mask(tok, MESSAGES[1:3])[0])
    out, stats = tokenize_records(recs, tok, max_length=n_short, overlong="truncate", drop_length_limited=True)
    assert [r["id"] for r in out] == ["short", "long"]
    assert stats.truncated == 1 and stats.dropped_length_limited == 1 and len(out[1]["input_ids"]) == n_short
    out, stats = tokenize_records(recs, tok, max_length=n_short, overlong="drop")
    assert [r["id"] for r in out] == ["short", "lim"] and stats.dropped_overlong == 1
    assert stats.kept + stats.dropped_overlong == stats.input == 3
    # truncated before any assistant token: dropped and counted, never silently kept with an empty mask
    out, stats = tokenize_records(recs[:1], tok, max_length=5)
    assert out == [] and stats.dropped_no_loss_tokens == 1 and "no loss tokens" in stats.rejects[0]["reason"]


def test_render_masked_highlights_trained_tokens(tok):
    tok.chat_template = read_template("chatml")
    ids, mask = tokenize_with_mask(tok, MESSAGES[1:3])
    text = render_masked(tok, ids, mask, color=False)
    assert "⟦I am fine, thank you.<|im_end|>⟧" in text
    assert "\x1b[30;42m" in render_masked(tok, ids, mask, color=True)
