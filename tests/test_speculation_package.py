"""Speculation is its own package (mdi.starter.speculation) and the pipeline asks it two things
only: which speculative passes to send (SpecDecoder.send) and what a verification that came
back accepts (SpecDecoder.verify). Checked on pipeline.py's source, so speculation logic that
creeps back into the pipeline (a third call, a sample's SpecState handled there) fails here."""
import ast
import os

from conftest import ROOT

from mdi.runconfig import SpeculationSpec
from mdi.starter.speculation import SpecDecoder

PIPELINE = os.path.join(ROOT, "mdi", "starter", "pipeline.py")


def _tree():
    with open(PIPELINE, encoding="utf-8") as f:
        return ast.parse(f.read(), PIPELINE)


def _is_decoder(node):
    """`self.decoder`."""
    return (isinstance(node, ast.Attribute) and node.attr == "decoder" and isinstance(node.value, ast.Name)
            and node.value.id == "self")


def test_the_pipeline_calls_its_decoder_in_exactly_two_places():
    calls = [node.func.attr for node in ast.walk(_tree())
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_decoder(node.func.value)]
    assert sorted(calls) == ["send", "verify"], calls


def test_the_decoder_is_not_passed_around_or_aliased():
    """The decoder is reached only as `self.decoder.<attribute>` (the calls above), its
    assignment, and the pipeline's fields that are the decoder's data (the engine, benchmarks
    and tests set them on the pipeline): never handed on or bound to another name, so the calls
    above are all there are."""
    tree = _tree()
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if not _is_decoder(node):
            continue
        parent = parents[node]
        if isinstance(parent, ast.Call):  # getattr / setattr in _decoder_field, by its argument
            assert isinstance(parent.func, ast.Name) and parent.func.id in ("getattr", "setattr"), ast.dump(parent)
            assert isinstance(parent.args[1], ast.Name), ast.dump(parent)
            continue
        assert isinstance(parent, ast.Attribute) or (
            isinstance(parent, ast.Assign) and node in parent.targets), ast.dump(parent)
    fields = [node.args[0].value for node in ast.walk(tree) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Name) and node.func.id == "_decoder_field"]
    assert fields and all(isinstance(f, str) for f in fields), fields
    decoder = SpecDecoder(SpeculationSpec(), 1, iter(()))
    assert not [f for f in fields if callable(getattr(decoder, f))], "a pipeline field that is a decoder method"


def test_the_pipeline_holds_no_speculation_state():
    """No sample's SpecState (Sample.spec) is read or written in the pipeline, and of the
    package it imports only the decoder and the types of its constructor's arguments (Drafter,
    DraftModel, PassCosts), which it hands to the decoder."""
    tree = _tree()
    spec_uses = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "spec"]
    assert not spec_uses, "pipeline.py handles Sample.spec at lines %s: that belongs to the decoder" % spec_uses
    imported = {(node.module, a.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("mdi.starter.speculation") for a in node.names}
    assert imported == {("mdi.starter.speculation.decoder", "SpecDecoder"),
                        ("mdi.starter.speculation.drafters", "Drafter"), ("mdi.starter.speculation.costs", "PassCosts"),
                        ("mdi.starter.speculation.draft_model", "DraftModel")}, imported
