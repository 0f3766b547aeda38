#!/usr/bin/env python3
"""llama.cpp peers for the speculative-decoding benchmark (issue 42): one prompt at a time, greedy,
N new tokens, 1 thread per process, decode tokens/s of

  plain   llama-completion on one process;
  lookup  llama-lookup on one process: llama.cpp's prompt-lookup n-gram speculation (n-grams of
          1-4 tokens over the prompt and the output so far, up to --n-draft drafted tokens per
          pass, verified in one batch), with its drafted / accepted counts;
  rpc3    llama-completion over two ggml-rpc-server -t 1 (3 processes x 1 thread, one sample),
          -ngl 21 as scripts/bench_peer.py places the layers (about 10 per process).

The prompts are the raw user messages of scripts/speculation_prompts.json, rendered with the
model's chat template exactly as mdi's /v1/chat does (mdi.serving.prompts.ChatTemplate), so a
benchmark gives mdi the same text. Answers stop at EOS (as a chat user sees them) unless
ignore_eos; each run is a fresh process, so no n-gram state is carried between prompts.

Decode tokens/s, both ways counting tokens produced by a decode pass (the first token comes from
the prompt pass and is not counted):
  plain / rpc3: eval runs / (eval time + sampling time), from llama.cpp's perf print;
  lookup: (n_predict - 1) / the decode loop's wall time (drafting and sampling included).

Used by a benchmark:
    import llama_peers as lp
    bins = lp.llama_bins()                       # builds llama-lookup / llama-completion once
    text = lp.chat_prompt(user_message)
    r = lp.llama_plain(text, 128, bins=bins)     # -> PeerRun
    r = lp.llama_lookup(text, 128, bins=bins, n_draft=3)
    with lp.rpc_servers(bins) as servers:
        r = lp.llama_rpc3(text, 128, servers, bins=bins)
    lp.ngram_reuse(prompt_ids, answer_ids)        # fraction of answer 3-grams found in the prompt

CLI (one run over both prompt sets; table + JSON):
    python scripts/llama_peers.py --n-tokens 128 --out results/llama_peers.json
"""
import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402  (adds the repo root to sys.path)
from bench_peer import CACHE, RpcServer, _bin_dir, _source_dir  # noqa: E402

ROOT = benchlib.ROOT
PROMPTS = os.path.join(ROOT, "scripts", "speculation_prompts.json")
TARGETS = ("llama-completion", "llama-lookup", "ggml-rpc-server", "llama-bench")
PEERS = ("plain", "lookup", "rpc3")
RPC_NGL = 21  # bench_peer's placement: layers 0-9 local, 10-20 on the first server, 21-29 + head on the second
CONTEXT = 2048  # the longest prompt (~450 tokens) plus the answer fits


@dataclasses.dataclass
class PeerRun:
    """One greedy generation by one peer on one prompt."""
    peer: str
    n_prompt: int
    n_generated: int  # tokens sampled, the first (from the prompt pass) included
    decode_tokens_per_s: float
    text: str  # the answer, without the prompt
    cmd: str
    wall_s: float
    drafted: Optional[int] = None  # lookup only
    accepted: Optional[int] = None
    acceptance: Optional[float] = None  # accepted / drafted
    accepted_per_pass: Optional[float] = None  # accepted tokens per verification pass
    raw: Dict[str, float] = dataclasses.field(default_factory=dict)  # the figures parsed from llama.cpp's log

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def log(msg: str) -> None:
    print("[%s] %s" % (time.strftime("%H:%M:%S"), msg), flush=True)


def default_gguf() -> str:
    from mdi.model.files.gguf import packaged_gguf_path
    return packaged_gguf_path("smollm2-135m")


def llama_bins(cache: str = CACHE) -> str:
    """The bin dir of bench_peer's llama.cpp build, with llama-completion and llama-lookup built
    into it when missing (cmake --build only: bench_peer configured it with the examples on)."""
    src = _source_dir(cache)
    if src is None:
        raise RuntimeError("no llama.cpp source in %s: run `python scripts/bench_peer.py --build-only` first" % cache)
    bins = _bin_dir(src)
    missing = [t for t in TARGETS if not os.path.isfile(os.path.join(bins, t))]
    if missing:
        nice = ["nice", "-n", "19"] if shutil.which("nice") else []
        cmd = nice + ["cmake", "--build", "build", "-j2", "--target"] + missing
        log("building %s (%s) ..." % (", ".join(missing), " ".join(cmd)))
        out = subprocess.run(cmd, cwd=src, capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            raise RuntimeError("llama.cpp build failed: %s" % (out.stdout + out.stderr)[-1500:])
    return bins


# --------------------------------------------------------------------------- prompts

def load_prompts(path: str = PROMPTS) -> Dict[str, List[str]]:
    """{"copy": [...], "free": [...]}: raw user messages."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    return {k: list(doc[k]) for k in ("copy", "free")}


_template_cache: Dict[str, Any] = {}


def _tokenizer(model: str = benchlib.DEFAULT_MODEL):
    if model not in _template_cache:
        from mdi.model.source import ModelSource
        _template_cache[model] = ModelSource(model).tokenizer
    return _template_cache[model]


def chat_prompt(message: str, model: str = benchlib.DEFAULT_MODEL) -> str:
    """The user message rendered with the model's chat template, as mdi's /v1/chat renders it
    (the default system turn, then '<|im_start|>assistant\\n' for SmolLM2-Instruct)."""
    from mdi.serving.prompts import ChatTemplate
    return ChatTemplate(_tokenizer(model)).render([{"role": "user", "content": message}])


def token_ids(text: str, model: str = benchlib.DEFAULT_MODEL) -> List[int]:
    return list(_tokenizer(model).encode(text))


def ngram_reuse(prompt_ids: Sequence[int], answer_ids: Sequence[int], n: int = 3) -> Optional[float]:
    """Fraction of the answer's n-grams (token ids, with repeats) that occur in the prompt: how
    much of the answer a prompt-lookup drafter could find. None when the answer is shorter than n."""
    seen = {tuple(prompt_ids[i:i + n]) for i in range(len(prompt_ids) - n + 1)}
    grams = [tuple(answer_ids[i:i + n]) for i in range(len(answer_ids) - n + 1)]
    if not grams:
        return None
    return sum(g in seen for g in grams) / len(grams)


# --------------------------------------------------------------------------- runs

_PERF = {"prompt_eval": r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens",
         "eval": r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs",
         "sampling": r"sampling time =\s*([\d.]+) ms"}


def _perf(text: str) -> Dict[str, float]:
    raw: Dict[str, float] = {}
    for key, pat in _PERF.items():
        m = None
        for m in re.finditer(pat, text):
            pass  # the last print is the run's (lookup prints the target's last)
        if m:
            raw[key + "_ms"] = float(m.group(1))
            if m.lastindex and m.lastindex > 1:
                raw[key + "_n"] = float(m.group(2))
    return raw


def _common_args(gguf: str, prompt: str, n_tokens: int, threads: int, ignore_eos: bool) -> List[str]:
    args = ["-m", gguf, "-t", str(threads), "-tb", str(threads), "-n", str(n_tokens), "--temp", "0",
            "-c", str(CONTEXT), "-p", prompt]
    return args + (["--ignore-eos"] if ignore_eos else [])


def _run(cmd: List[str], timeout: float) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise RuntimeError("%s failed (rc %d): %s" % (os.path.basename(cmd[0]), out.returncode, out.stderr[-1500:]))
    return out


def _answer(text: str) -> str:
    text = text.replace("[end of text]", "")
    return re.sub(r"<\|im_end\|>\s*$", "", text.rstrip()).strip()


def llama_plain(prompt: str, n_tokens: int = 128, threads: int = 1, bins: Optional[str] = None,
                gguf: Optional[str] = None, ignore_eos: bool = False, rpc: Optional[List[RpcServer]] = None,
                ngl: int = RPC_NGL, peer: str = "plain", timeout: float = 600) -> PeerRun:
    """llama-completion, greedy, on the rendered prompt (special tokens parsed); over `rpc`
    servers with -ngl `ngl` when given."""
    bins = bins or llama_bins()
    cmd = [os.path.join(bins, "llama-completion")] + _common_args(gguf or default_gguf(), prompt, n_tokens, threads,
                                                                  ignore_eos)
    cmd += ["-no-cnv", "--no-display-prompt"]
    if rpc:
        cmd += ["--rpc", ",".join("127.0.0.1:%d" % s.port for s in rpc), "-ngl", str(ngl)]
    t0 = time.perf_counter()
    out = _run(cmd, timeout)
    wall = time.perf_counter() - t0
    raw = _perf(out.stderr)
    if "eval_ms" not in raw:
        raise RuntimeError("no eval time in llama-completion's log: %s" % out.stderr[-800:])
    runs = raw["eval_n"]
    tps = runs / ((raw["eval_ms"] + raw.get("sampling_ms", 0.0)) / 1000.0)
    return PeerRun(peer=peer, n_prompt=int(raw.get("prompt_eval_n", 0)), n_generated=int(runs) + 1,
                   decode_tokens_per_s=tps, text=_answer(out.stdout), cmd=_cmd_text(cmd), wall_s=wall, raw=raw)


def llama_lookup(prompt: str, n_tokens: int = 128, threads: int = 1, n_draft: int = 3, bins: Optional[str] = None,
                 gguf: Optional[str] = None, ignore_eos: bool = False, timeout: float = 600) -> PeerRun:
    """llama-lookup (examples/lookup), greedy: prompt-lookup n-gram drafting, n_draft tokens at most
    per pass (--spec-draft-n-max); no static or dynamic n-gram cache file, so each run is cold."""
    bins = bins or llama_bins()
    cmd = [os.path.join(bins, "llama-lookup")] + _common_args(gguf or default_gguf(), prompt, n_tokens, threads,
                                                              ignore_eos)
    cmd += ["--spec-draft-n-max", str(n_draft)]
    t0 = time.perf_counter()
    out = _run(cmd, timeout)
    wall = time.perf_counter() - t0
    err = out.stderr
    raw = _perf(err)
    found = {}
    for key, pat in (("encoded", r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
                     ("decoded", r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")):
        m = re.search(pat, err)
        if not m:
            raise RuntimeError("no '%s' line in llama-lookup's log: %s" % (key, err[-800:]))
        found[key] = (int(m.group(1)), float(m.group(2)))
        raw[key + "_n"], raw[key + "_s"] = float(m.group(1)), float(m.group(2))
    for key in ("n_drafted", "n_accept"):
        m = re.search(r"%s\s*=\s*(\d+)" % key, err)
        raw[key] = float(m.group(1)) if m else float("nan")
    n_predict, t_dec = found["decoded"]
    drafted, accepted = int(raw["n_drafted"]), int(raw["n_accept"])
    # one llama_decode per pass after the prompt, each yielding its accepted drafts plus one token
    # (llama.cpp's own perf print counts multi-token passes as "prompt eval", so it cannot say)
    passes = n_predict - 1 - accepted
    # stdout: the prompt's pieces (special tokens printed), then the answer
    text = out.stdout
    i = text.find("<|im_start|>assistant\n")
    answer = text[i + len("<|im_start|>assistant\n"):] if i >= 0 else text
    return PeerRun(peer="lookup", n_prompt=found["encoded"][0], n_generated=n_predict,
                   decode_tokens_per_s=(n_predict - 1) / t_dec if t_dec > 0 else float("nan"),
                   text=_answer(answer), cmd=_cmd_text(cmd), wall_s=wall, drafted=drafted, accepted=accepted,
                   acceptance=accepted / drafted if drafted else None,
                   accepted_per_pass=accepted / passes if passes else None, raw=raw)


@contextlib.contextmanager
def rpc_servers(bins: Optional[str] = None, n: int = 2, log_dir: Optional[str] = None) -> Iterator[List[RpcServer]]:
    """n ggml-rpc-server -t 1 on loopback (bench_peer.RpcServer), stopped by their PIDs on exit."""
    import tempfile
    bins = bins or llama_bins()
    log_dir = log_dir or tempfile.mkdtemp(prefix="llama-peers-")
    servers: List[RpcServer] = []
    try:
        for i in range(1, n + 1):
            servers.append(RpcServer(bins, log_dir, i))
        for s in servers:
            s.wait_ready(60)
        yield servers
    finally:
        for s in servers:
            s.stop()


def llama_rpc3(prompt: str, n_tokens: int, servers: List[RpcServer], bins: Optional[str] = None,
               gguf: Optional[str] = None, ignore_eos: bool = False, ngl: int = RPC_NGL) -> PeerRun:
    """llama-completion -t 1 over two ggml-rpc-server -t 1: 3 processes x 1 thread, one sample."""
    return llama_plain(prompt, n_tokens, 1, bins=bins, gguf=gguf, ignore_eos=ignore_eos, rpc=servers, ngl=ngl,
                       peer="rpc3")


def _cmd_text(cmd: List[str]) -> str:
    # the prompt is hundreds of characters: the record keeps its index instead
    return " ".join("PROMPT" if len(c) > 80 else c for c in cmd)


# --------------------------------------------------------------------------- one run over the sets

def peer_names(peers: Sequence[str], n_drafts: Sequence[int]) -> List[str]:
    """"lookup" becomes one peer per draft size: lookup_d3, lookup_d8, ..."""
    out: List[str] = []
    for p in peers:
        out += ["lookup_d%d" % n for n in n_drafts] if p == "lookup" else [p]
    return out


def run_sets(prompts: Dict[str, List[str]], n_tokens: int = 128, peers: Sequence[str] = PEERS,
             n_drafts: Sequence[int] = (3,), ignore_eos: bool = False, bins: Optional[str] = None,
             gguf: Optional[str] = None, limit: Optional[int] = None) -> Dict[str, Any]:
    """Every peer on every prompt (the order flips per prompt; each run a fresh process, so cold).
    Returns {"sets": {name: {"runs": [...], "summary": {...}}}}."""
    bins = bins or llama_bins()
    gguf = gguf or default_gguf()
    names = peer_names(peers, n_drafts)
    record: Dict[str, Any] = {"sets": {}, "peers": names}
    with contextlib.ExitStack() as stack:
        servers = stack.enter_context(rpc_servers(bins)) if "rpc3" in peers else []
        for name, messages in prompts.items():
            rows = []
            for i, message in enumerate(messages[:limit]):
                text = chat_prompt(message)
                prompt_ids = token_ids(text)
                row: Dict[str, Any] = {"index": i, "prompt_tokens": len(prompt_ids)}
                for peer in (names if i % 2 == 0 else list(reversed(names))):  # neither always goes first
                    if peer == "plain":
                        r = llama_plain(text, n_tokens, bins=bins, gguf=gguf, ignore_eos=ignore_eos)
                    elif peer == "rpc3":
                        r = llama_rpc3(text, n_tokens, servers, bins=bins, gguf=gguf, ignore_eos=ignore_eos)
                    else:
                        r = llama_lookup(text, n_tokens, bins=bins, gguf=gguf, n_draft=int(peer[len("lookup_d"):]),
                                         ignore_eos=ignore_eos)
                        r.peer = peer
                    row[peer] = r.to_dict()
                ref = row.get("plain") or row[names[0]]
                answer_ids = token_ids(ref["text"])
                row["answer_tokens"] = len(answer_ids)
                row["answer_3gram_reuse"] = ngram_reuse(prompt_ids, answer_ids)
                for peer in names:
                    if peer.startswith("lookup") and "plain" in row:
                        # batched verification rounds differently from one-row decode: greedy can flip.
                        # lookup may overshoot -n by its last pass's accepted drafts: compare the common length
                        a, b = row[peer]["text"], row["plain"]["text"]
                        row[peer]["chars_equal_to_plain"] = _common_prefix(a, b)
                        row[peer]["same_text_as_plain"] = row[peer]["chars_equal_to_plain"] == min(len(a), len(b))
                log("%s %2d (%d prompt tokens): %s; answer 3-gram reuse %s" % (
                    name, i, len(prompt_ids), ", ".join("%s %.1f" % (p, row[p]["decode_tokens_per_s"]) for p in names),
                    "%.2f" % row["answer_3gram_reuse"] if row["answer_3gram_reuse"] is not None else "n/a"))
                rows.append(row)
            record["sets"][name] = {"runs": rows, "summary": summarize_set(rows, names)}
    return record


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def summarize_set(rows: List[Dict[str, Any]], peers: Sequence[str]) -> Dict[str, Any]:
    def stat(values: Sequence[Optional[float]]) -> Dict[str, Any]:
        return benchlib.summarize([v for v in values if v is not None])

    out: Dict[str, Any] = {}
    for p in peers:
        s: Dict[str, Any] = {"decode_tokens_per_s": stat([r[p]["decode_tokens_per_s"] for r in rows]),
                             "n_generated": stat([r[p]["n_generated"] for r in rows])}
        if "plain" in peers and p != "plain":
            s["over_plain"] = stat([r[p]["decode_tokens_per_s"] / r["plain"]["decode_tokens_per_s"] for r in rows])
        if p.startswith("lookup"):
            drafted = sum(r[p]["drafted"] for r in rows)
            s["acceptance"] = stat([r[p]["acceptance"] for r in rows])
            s["acceptance_pooled"] = sum(r[p]["accepted"] for r in rows) / drafted if drafted else None
            s["accepted_per_pass"] = stat([r[p]["accepted_per_pass"] for r in rows])
            if "plain" in peers:
                s["same_text_as_plain"] = sum(bool(r[p].get("same_text_as_plain")) for r in rows)
        out[p] = s
    out["answer_3gram_reuse"] = stat([r["answer_3gram_reuse"] for r in rows])
    out["answer_tokens"] = stat([r["answer_tokens"] for r in rows])
    out["n_prompts"] = len(rows)
    return out


def pass_cost(rows: Sequence[int] = (1, 2, 3, 4, 5, 9, 16), threads: int = 1, repeats: int = 3,
              bins: Optional[str] = None, gguf: Optional[str] = None) -> Dict[str, Any]:
    """What a verification pass of k+1 rows costs against one row: llama-bench -p ROWS -n 0
    (one batch of ROWS tokens from an empty cache). {"ms_per_pass": {rows: ms}, "x_one_row": {rows: x}}."""
    bins = bins or llama_bins()
    cmd = [os.path.join(bins, "llama-bench"), "-m", gguf or default_gguf(), "-t", str(threads),
           "-p", ",".join(str(r) for r in rows), "-n", "0", "-r", str(repeats), "-o", "json"]
    out = _run(cmd, 600)
    ms = {int(r["n_prompt"]): 1000.0 * int(r["n_prompt"]) / float(r["avg_ts"]) for r in json.loads(out.stdout)}
    one = ms.get(1)
    return {"cmd": " ".join(cmd), "ms_per_pass": ms,
            "x_one_row": {k: v / one for k, v in ms.items()} if one else {}}


def report(record: Dict[str, Any]) -> None:
    rows = []
    for name, s in record["sets"].items():
        for p in record["peers"]:
            sm = s["summary"][p]
            extra = ""
            if p.startswith("lookup"):
                extra = "acc %s (pooled %.2f), %s acc/pass, %d/%d same text" % (
                    benchlib.fmt_stat(sm["acceptance"], "%.2f"), sm["acceptance_pooled"] or 0.0,
                    benchlib.fmt_stat(sm["accepted_per_pass"], "%.2f"), sm.get("same_text_as_plain", -1),
                    s["summary"]["n_prompts"])
            rows.append([name, p, benchlib.fmt_stat(sm["decode_tokens_per_s"]),
                         benchlib.fmt_stat(sm["over_plain"], "%.2f") if "over_plain" in sm else "",
                         benchlib.fmt_stat(sm["n_generated"], "%.0f"),
                         benchlib.fmt_stat(s["summary"]["answer_3gram_reuse"], "%.2f"), extra])
    benchlib.print_table("llama.cpp peers, greedy, 1 thread per process: median [min, max] over prompts",
                         ["set", "peer", "decode tok/s", "x plain (per prompt)", "tokens", "answer 3-gram reuse",
                          "lookup"], rows)
    pc = record.get("pass_cost")
    if pc and pc.get("x_one_row"):
        print("a pass of k rows costs (x one row, llama-bench -t 1): " + ", ".join(
            "%s: %.2f" % (k, v) for k, v in sorted(pc["x_one_row"].items(), key=lambda kv: int(kv[0]))))


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompts", default=PROMPTS)
    p.add_argument("--sets", default="copy,free")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--n-tokens", type=int, default=128)
    p.add_argument("--n-draft", default="3", help="llama-lookup --spec-draft-n-max, comma-separated: one "
                   "lookup peer each (3 is llama.cpp's default)")
    p.add_argument("--no-pass-cost", action="store_true", help="skip llama-bench's pass cost by rows")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --n-tokens (default: stop at EOS)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each set")
    p.add_argument("--gguf", default=None)
    p.add_argument("--cache", default=CACHE, help="bench_peer's llama.cpp cache folder (git-ignored)")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "llama_peers.json"))
    args = p.parse_args(argv)
    peers = [x for x in args.peers.split(",") if x]
    bad = [x for x in peers if x not in PEERS]
    if bad:
        p.error("unknown peer(s) %s; choose from %s" % (", ".join(bad), ", ".join(PEERS)))
    info = benchlib.machine_info(1)  # cpu: torch's get_cpu_capability() and the CPU flags that matter
    bins = llama_bins(args.cache)
    gguf = args.gguf or default_gguf()
    prompts = {k: v for k, v in load_prompts(args.prompts).items() if k in args.sets.split(",")}
    t0 = time.perf_counter()
    n_drafts = [int(x) for x in args.n_draft.split(",") if x]
    record = run_sets(prompts, args.n_tokens, peers, n_drafts, args.ignore_eos, bins, gguf, args.limit)
    if not args.no_pass_cost:
        record["pass_cost"] = pass_cost(bins=bins, gguf=gguf)
    benchlib.finish_machine_info(info)
    version = subprocess.run([os.path.join(bins, "llama-completion"), "--version"], capture_output=True,
                             text=True, timeout=60)
    record.update({"benchmark": "llama_peers", "machine": info, "gguf": gguf, "args": vars(args),
                   "llama_cpp_version": (version.stdout + version.stderr).strip().splitlines()[-2:],
                   "measure_seconds": round(time.perf_counter() - t0, 1),
                   "method": __doc__.split("\n\n")[0:4]})
    report(record)
    print(benchlib.note_load(info))
    benchlib.save_record(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
