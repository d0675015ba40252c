"""The target adapter's HF code paths: decoder layers driven directly, and the model's own forward for
families outside SUPPORTED_FAMILIES. The fused path is pinned by test_fused_decoder.py."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from eagle import EaModel, EagleHead
from eagle.target import SUPPORTED_FAMILIES, Target, cache_kwarg
from float_tolerance import LAYER_REDUCTIONS, assert_same_function
from tiny_models import hf_greedy, random_prompts, single_thread, tiny_target  # noqa: F401

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.numeric]  # numeric: tests/float_variants.py


def same_hidden(actual, expected, layers: int, msg=""):
    """Hidden states of a `layers`-layer tiny target (+ final norm) by two code paths; longest reduction: the MLP's
    128 terms."""
    assert_same_function(actual, expected, terms=128, chained=layers * LAYER_REDUCTIONS + 1, msg=msg)


class _NewLayer(nn.Module):  # transformers after the rename
    def forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
        return hidden_states


class _OldLayer(nn.Module):  # transformers 5.0-era signature
    def forward(self, hidden_states, attention_mask=None, past_key_values=None, **kwargs):
        return hidden_states


def test_cache_kwarg_follows_the_installed_signature():
    assert cache_kwarg(_NewLayer()) == "cache"
    assert cache_kwarg(_OldLayer()) == "past_key_values"


@pytest.mark.parametrize("path", ["hf layers", "model forward"])
def test_hf_paths_fill_our_cache_and_match_hf_greedy_without_deprecation_warnings(path):
    """The KV cache reaches the attention under the keyword this transformers takes (a deprecated keyword
    would land in **kwargs once removed, and every step would silently run without the cache)."""
    model = tiny_target("llama" if path == "hf layers" else "gemma")
    ea = EaModel(model, EagleHead.from_target(model), fused_target=False)
    assert ea.target.fused is None
    assert ea.target.direct_layers == (path == "hf layers")
    assert (model.config.model_type in SUPPORTED_FAMILIES) == (path == "hf layers")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        for prompt in random_prompts(4, seed=3):
            got = ea.eagenerate(prompt, max_new_tokens=20)
            assert torch.equal(got, hf_greedy(model, prompt, 20))
            # every committed position's K/V is in the cache: prompt + 20 new tokens - the last (not yet run)
            assert ea.target.length == prompt.shape[1] + 19


def test_model_forward_path_verifies_a_tree_as_one_forward_of_its_paths():
    """Tree mask + position ids through the model's own forward: each node's hidden state equals the one
    computed by running its root->node path as a plain sequence."""
    model = tiny_target("gemma")
    t = Target(model, capacity=64)
    assert not t.direct_layers
    prompt = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    parents = [-1, 0, 0, 1]  # root, two children, a grandchild under node 1
    tokens = torch.tensor([[5, 17, 40, 99]])
    depth = torch.tensor([0, 1, 1, 2])
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    t.reset(64)
    t.forward(prompt)
    tree_h = t.forward(tokens, depth + prompt.shape[1], anc)[0]  # [4, H]
    for node in range(4):
        path, j = [], node
        while j >= 0:
            path.append(j)
            j = parents[j]
        seq = torch.cat([prompt, tokens[:, path[::-1]]], dim=1)
        t.reset(64)
        ref = t.forward(seq)[0, -1]  # [H]
        same_hidden(tree_h[node], ref, layers=2, msg=f"node {node}")


@pytest.mark.parametrize("path", ["fused", "hf layers", "model forward"])
def test_aux_layer_states_are_hf_hidden_states_on_every_path(path):
    """EAGLE-3's aux states: id j = HF output_hidden_states[j] (the input of decoder layer j, 0 = embeddings), at
    prefill, for one appended token and for every node of a verified tree (= its root->node path run as a sequence)."""
    model = tiny_target("gemma" if path == "model forward" else "llama", num_layers=4)
    t = Target(model, capacity=64, fused=None if path == "fused" else False)
    assert (t.fused is not None, t.direct_layers) == {"fused": (True, True), "hf layers": (False, True),
                                                      "model forward": (False, False)}[path]
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    aux_ids = (0, 2, 3)
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
        want = torch.cat([ref.hidden_states[i] for i in aux_ids], -1)  # [1, 9, 3H]
        t.reset(64)
        hidden, aux = t.forward(ids[:, :8], aux_layers=aux_ids)
        same_hidden(aux, want[:, :8], layers=4)
        same_hidden(hidden, ref.hidden_states[-1][:, :8], layers=4)
        _, aux = t.forward(ids[:, 8:], aux_layers=aux_ids)
        same_hidden(aux, want[:, 8:], layers=4)
        # a tree: root, two children, a grandchild under node 1
        parents, tokens = [-1, 0, 0, 1], torch.tensor([[5, 17, 40, 99]])
        anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        t.reset(64)
        assert isinstance(t.forward(ids), torch.Tensor)  # without aux_layers: the hidden states only (EAGLE-2)
        _, tree_aux = t.forward(tokens, torch.tensor([0, 1, 1, 2]) + 9, anc, aux_layers=aux_ids)
        for node in range(4):
            path_nodes, j = [], node
            while j >= 0:
                path_nodes.append(j)
                j = parents[j]
            seq = torch.cat([ids, tokens[:, path_nodes[::-1]]], dim=1)
            hs = model(seq, output_hidden_states=True).hidden_states
            same_hidden(tree_aux[0, node], torch.cat([hs[i][0, -1] for i in aux_ids]), layers=4, msg=f"node {node}")
