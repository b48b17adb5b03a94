"""A policy string means the same whatever the order of its entries where the grammar says order
does not matter: class rules and op rules in any order, and either kind anywhere among the name
globs (only the globs' own order counts: the first match wins). Property over permutations."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings
from torch import nn

import mixprec

CLASSES = ["nn.LayerNorm=fp32", "nn.Linear=bf16", "nn.GELU=fp32", "nn.Embedding=fp32"]
OPS = ["torch.softmax=fp32", "F.gelu=fp32", "torch.cumsum=fp32"]
GLOBS = ["blocks.0.*=fp32", "blocks.*.fc=fp16", "head=bf16"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc, self.act = nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU()


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 10)


MODEL = Model()


@settings(max_examples=60, deadline=None)
@given(
    classes=st.permutations(CLASSES),
    ops=st.permutations(OPS),
    where=st.lists(st.integers(0, len(GLOBS)), min_size=len(CLASSES) + len(OPS), max_size=7),
)
def test_class_and_op_rules_mean_the_same_in_any_order(
    classes: list[str], ops: list[str], where: list[int]
) -> None:
    reference = mixprec.Policy(", ".join(GLOBS + CLASSES + OPS))
    entries = list(GLOBS)
    for entry, at in zip(classes + ops, where, strict=True):  # globs keep their own order
        slot = [k for k, e in enumerate(entries) if e in GLOBS][at] if at < len(GLOBS) else None
        entries.insert(len(entries) if slot is None else slot, entry)
    shuffled = mixprec.Policy(", ".join(entries))
    assert shuffled == reference and hash(shuffled) == hash(reference)
    assert shuffled.resolve(MODEL) == reference.resolve(MODEL)
    assert mixprec.Policy(str(shuffled)) == reference


def test_the_order_of_globs_is_kept_where_it_decides() -> None:
    """The control: two globs matching one module mean different policies in the two orders."""
    first = mixprec.Policy("blocks.0.*=fp32, blocks.*.fc=fp16")
    second = mixprec.Policy("blocks.*.fc=fp16, blocks.0.*=fp32")
    assert first != second
    assert first.resolve(MODEL)["blocks.0.fc"] != second.resolve(MODEL)["blocks.0.fc"]
