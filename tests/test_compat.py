"""The runtime package stays importable on Jetson (Python 3.8, torch 2.0) and never runs
untrusted bytes as code."""
import os
import re
import subprocess
import sys

from conftest import ROOT

PACKAGE = os.path.join(ROOT, "mdi")


def test_runtime_passes_vermin_for_python_3_8():
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "vermin"), "--target=3.8-", "--no-tips", "--violations", "--eval-annotations",
                           "--backport", "typing", "-q", PACKAGE], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_unsafe_deserialisation_or_code_execution():
    bad = re.compile(r"\bpickle\b|(?<![.\w])eval\(|(?<![.\w])exec\(|torch\.load\((?![^)]*weights_only=True)|"
                     r"nn\.RMSNorm|enable_gqa")
    offenders = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                for n, line in enumerate(open(path, encoding="utf-8"), 1):
                    code = line.split("#", 1)[0]
                    if bad.search(code):
                        offenders.append("%s:%d: %s" % (os.path.relpath(path, ROOT), n, line.strip()))
    assert not offenders, "\n".join(offenders)


def test_attention_scales_queries_on_a_torch_without_sdpa_s_scale(monkeypatch):
    """torch 2.0 (JetPack 5) refuses SDPA's `scale`, which every Gemma 3 layer passes (h36): the
    scale is folded into the queries there, to the same result."""
    import torch
    from mdi.model import attention
    q, k, v = (torch.randn(1, 4, 5, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    want = attention.sdpa(q, k, v, mask, 0.0625)
    torch.jit.script(attention._sdpa_folding_scale)  # the TorchScript decode scripts it: no Python globals
    real = attention.F.scaled_dot_product_attention

    def torch_2_0(*args, **kwargs):
        if "scale" in kwargs:
            raise TypeError("scaled_dot_product_attention() got an unexpected keyword argument 'scale'")
        return real(*args, **kwargs)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", torch_2_0)
    assert torch.allclose(attention._sdpa_folding_scale(q, k, v, mask, 0.0625), want, atol=1e-6)
