"""Malformed model files are one-line errors naming the file or the key, never tracebacks
(issue 40, item 9): a config.json that is not JSON, not an object, or holds a count that is a
string, a fraction, a bool, negative, NaN or absurdly large; a tokenizer.json the tokenizers
library cannot read. ModelConfig checks every value whatever it came from."""
import json
import struct

import msgpack
import numpy as np
import pytest

from mdi.cli.prepare import prepare_main
from mdi.model.config import ModelConfig
from mdi.model.files.checkpoints import read_hf_dir
from mdi.model.files.tokenizer_import import tokenizer_from_hf_dir
from mdi.model.layout import CheckpointError
from mdi.model.tokenizers import TokenizerError, load_tokenizer
from mdi.ring.init_request import RequestError, model_field

LLAMA = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}


def hf_dir(tmp_path, text):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(text)
    return str(d)


@pytest.mark.parametrize("text,words", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ("[" * 100000 + "]" * 100000, "JSON"),
    (json.dumps(dict(LLAMA, num_hidden_layers="x")), "num_hidden_layers must be an integer"),  # config.json's name
    (json.dumps(dict(LLAMA, hidden_size=64.5)), "hidden_size must be an integer"),
    (json.dumps(dict(LLAMA, num_attention_heads=True)), "num_attention_heads must be an integer"),
    (json.dumps(dict(LLAMA, num_hidden_layers=-2)), "n_layer must be an integer"),
    (json.dumps(dict(LLAMA, max_position_embeddings=2 ** 40)), "block_size must be an integer"),
    (json.dumps(dict(LLAMA, vocab_size=0)), "vocab_size must be an integer"),
    (json.dumps(dict(LLAMA, rms_norm_eps=float("nan"))), "norm_eps must be a positive finite number"),
    (json.dumps(dict(LLAMA, rope_theta=-5.0)), "rope_theta must be a positive finite number"),
    (json.dumps(dict(LLAMA, eos_token_id="</s>")), "eos_token_id must be a token id"),
    (json.dumps({k: v for k, v in LLAMA.items() if k != "vocab_size"}), "vocab_size"),
    # an odd head size: ggml's RoPE aborted a worker's process (GGML_ASSERT) on its first frame
    (json.dumps(dict(LLAMA, num_attention_heads=64, num_key_value_heads=16)), "must be even"),  # head size 1
], ids=["not-json", "list", "deep", "str", "fraction", "bool", "negative", "huge-context", "zero-vocab", "nan",
        "negative-theta", "str-token", "missing", "odd-head"])
def test_a_malformed_config_json_is_one_line_naming_it(tmp_path, text, words):
    path = hf_dir(tmp_path, text)
    with pytest.raises(CheckpointError) as e:
        read_hf_dir(path)
    message = str(e.value)
    assert "\n" not in message and path in message and words in message, message


def test_mdi_prepare_says_it_in_one_line(tmp_path, capsys):
    path = hf_dir(tmp_path, json.dumps(dict(LLAMA, num_hidden_layers="x")))
    assert prepare_main([path, "--out", str(tmp_path / "out")]) != 0
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "num_hidden_layers must be an integer" in errors[0], errors


@pytest.mark.parametrize("text", ["{bad", "[1]", '{"version": "1.0", "model": null}',
                                  '{"model": {"type": "BPE", "vocab": "x"}}'])
def test_a_malformed_tokenizer_json_is_one_line_naming_it(tmp_path, text):
    (tmp_path / "tokenizer.json").write_text(text)
    with pytest.raises(TokenizerError) as e:
        tokenizer_from_hf_dir(str(tmp_path))
    message = str(e.value)
    assert "\n" not in message and "tokenizer.json" in message and "not a valid tokenizer.json" in message


SPM_OK = {"tokens": [b"<unk>", b"a", b"b"], "scores": struct.pack("<3f", 0.0, -1.0, -2.0), "types": bytes([2, 1, 1]),
          "add_space_prefix": False, "unknown_id": 0}


@pytest.mark.parametrize("vocab,words", [
    (b"\xc1", "cannot read"),
    ([1], "expected a map"),
    (dict(SPM_OK, tokens=[b"a", 1, b"b"]), "'tokens' must be a list of byte strings"),
    (dict(SPM_OK, tokens=["<unk>", "a", "b"]), "'tokens' must be a list of byte strings"),
    (dict(SPM_OK, scores=[0.0, -1.0, -2.0]), "'scores' must be float32 bytes"),
    (dict(SPM_OK, scores=b"\0" * 7), "'scores' must be float32 bytes"),
    (dict(SPM_OK, types=[1, 1, 1]), "'types' must be bytes"),
    (dict(SPM_OK, types=bytes([2, 6, 1])), "byte token 1 is b'a', not <0xXX>"),
    (dict(SPM_OK, scores=b"\0" * 4), "as many scores and types as tokens"),
    (dict(SPM_OK, tokens=[b"a", b"a", b"b"]), "repeats a token"),
    (dict(SPM_OK, tokens=[b"\xff", b"a", b"b"]), "not UTF-8"),
    (dict(SPM_OK, unknown_id=7), "unknown token id 7 out of range"),
    (dict(SPM_OK, merges=[]), "unknown keys merges"),
], ids=["not-msgpack", "list", "token", "str-token", "score-list", "score-bytes", "type-list", "byte-token", "short",
        "repeat", "not-utf8", "unknown-id", "key"])
def test_a_malformed_sentencepiece_vocabulary_is_one_line_naming_it(tmp_path, vocab, words):
    """A prepared directory's tokenizer_spm.msgpack (llama.cpp's SentencePiece for a GGUF vocabulary)."""
    (tmp_path / "tokenizer_mdi.json").write_text(json.dumps({"kind": "spm", "bos_id": None, "eos_id": None}))
    path = tmp_path / "tokenizer_spm.msgpack"
    path.write_bytes(vocab if isinstance(vocab, bytes) else msgpack.packb(vocab, use_bin_type=True))
    with pytest.raises(TokenizerError) as e:
        load_tokenizer(str(tmp_path))
    message = str(e.value)
    assert "\n" not in message and str(path) in message and words in message, message
    path.write_bytes(msgpack.packb(SPM_OK, use_bin_type=True))
    assert load_tokenizer(str(tmp_path)).encode("ab") == [1, 2]


def _bpe_gguf(path, tokens, merges):
    """A GGUF holding only a "gpt2" (byte-level BPE) vocabulary, as llama.cpp writes it."""
    import gguf
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(merges)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("tokens,merges,words", [
    (["a", "b", "ab"], ["a b", "ab c"], "tokenizer.ggml.merges do not fit the 3 tokenizer.ggml.tokens"),
    (["a", "b", "ab"], ["a b", "ab"], "tokenizer.ggml.merges entry 1 ('ab') is not two tokens"),
    (["a", "b", "ab"], ["a b c"], "tokenizer.ggml.merges entry 0 ('a b c') is not two tokens"),
], ids=["token-outside-the-list", "no-space", "three-parts"])
def test_gguf_bpe_merges_that_do_not_fit_the_tokens_are_one_line_naming_the_key(tmp_path, tokens, merges, words):
    """The tokenizers library raises a bare Exception (a merge naming a token outside the list: a
    tokens list cut short) or a TypeError (a merge without a space) with neither file nor key."""
    from mdi.model.files.tokenizer_import import tokenizer_from_gguf
    path = _bpe_gguf(str(tmp_path / "bpe.gguf"), tokens, merges)
    with pytest.raises(TokenizerError) as e:
        tokenizer_from_gguf(path)
    message = str(e.value)
    assert "\n" not in message and path in message and words in message, message
    assert tokenizer_from_gguf(_bpe_gguf(str(tmp_path / "ok.gguf"), tokens, ["a b"])).encode("ab") == [2]


def test_model_config_takes_numpy_counts_and_refuses_the_rest():
    """A GGUF's metadata comes as numpy integers: counts, converted to int; a request's model
    goes through the same checks (a 400 naming the key)."""
    config = ModelConfig(vocab_size=np.uint32(100), n_layer=np.int64(2), n_embd=64, n_head=4, block_size=128)
    assert type(config.vocab_size) is int and type(config.n_layer) is int and config.to_dict()["n_layer"] == 2
    for bad in ({"n_layer": 2.0}, {"n_embd": "64"}, {"block_size": 1 << 25}, {"norm_eps": float("inf")},
                {"bos_token_id": -1}):
        with pytest.raises(ValueError):
            ModelConfig(**dict({"n_embd": 64, "n_head": 4}, **bad))
        with pytest.raises(RequestError, match="model: "):
            model_field(dict(ModelConfig(n_embd=64, n_head=4).to_dict(), **bad))


def test_a_gguf_where_safetensors_are_read_is_named_a_gguf(tmp_path):
    """A torch node given a GGUF as its weights (valid for a ggml node) says what the file is
    and what reads it, not "header too large"; other bytes stay "not a valid safetensors file"."""
    from mdi.model.files.store import read_tensors
    gguf, junk = tmp_path / "model.gguf", tmp_path / "junk.safetensors"
    gguf.write_bytes(b"GGUF" + struct.pack("<I", 3) + bytes(64))
    junk.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"model\.gguf is a GGUF: ggml computes it \(backend: ggml\)"):
        read_tensors(str(gguf), ["x"])
    with pytest.raises(CheckpointError, match="junk.safetensors is not a valid safetensors file"):
        read_tensors(str(junk), ["x"])


@pytest.mark.parametrize("content", [b"GGUF" + b"x" * 24, b"not a gguf at all", b""])
def test_a_file_that_is_no_gguf_is_one_line_naming_it_once(tmp_path, content):
    """The reader's own message named the file again: "X: not a readable GGUF file (X: ...)" (h79)."""
    from mdi.model.files.gguf import read_gguf
    from mdi.model.layout import CheckpointError
    from mdi.model.source import ModelSource
    path = str(tmp_path / "m.gguf")
    with open(path, "wb") as f:
        f.write(content)
    for read in (read_gguf, lambda p: ModelSource(p).config):
        with pytest.raises(CheckpointError) as e:
            read(path)
        message = str(e.value)
        assert message.startswith(path + ": not a readable GGUF file (") and message.count(path) == 1, message
        assert "\n" not in message
