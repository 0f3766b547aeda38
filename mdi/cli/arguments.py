"""Argument types and the argument groups several programs share (quantization, kernels)."""
import argparse
from typing import Any, Callable


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with its errors in one line (argparse prints its whole usage block
    first: 14 lines for mdi-start before the one that says what was wrong)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, "mdi: error: %s (%s --help lists the options)\n" % (message, self.prog))


def arg_type(convert: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse `type=`: `convert`, then `ok`, else a one-line error (ArgumentParser.error)."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError("expected %s, got %r" % (expected, text))
        return value
    return parse


# The OS would take port 80000 modulo 65536 and bind another port.
tcp_port = arg_type(int, lambda p: 1 <= p <= 65535, "a TCP port 1-65535")
positive_int = arg_type(int, lambda v: v >= 1, "an integer >= 1")
# runtime.threads from the command line: a count, or auto (the node's usable cores, as the config's)
thread_count = arg_type(lambda t: t if t == "auto" else int(t), lambda v: v == "auto" or v >= 1,
                        "an integer >= 1 or auto")
positive_float = arg_type(float, lambda v: 0 < v < float("inf"), "a number > 0")  # NaN fails too


def device_name(value: str) -> str:
    """cpu, cuda or cuda:N (argparse's type: a wrong one is a one-line usage error)."""
    from mdi.runconfig.nodes import is_device_name
    if is_device_name(value):
        return value
    raise argparse.ArgumentTypeError("expected cpu, cuda or cuda:N, got %r" % value)


def kv_type(value: str) -> str:
    """--kv-type: f16, q8_0 or f32 (float16 and float32 as model.dtype spells them)."""
    from mdi.model.backend import KV_TYPES, kv_type_name
    name = kv_type_name(value)
    if name is None:
        raise argparse.ArgumentTypeError("expected one of %s, got %r" % (", ".join(KV_TYPES), value))
    return name


def quant_mode(value: str) -> str:
    """--quant of a run: none, auto, int8 or int4 (a GGUF type: the message says where it goes)."""
    from mdi.model.layout import quant_mode_problem
    problem = quant_mode_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


def add_quant_arguments(p: argparse.ArgumentParser, gguf_types: bool = False) -> None:
    """`gguf_types`: --quant also takes a GGUF type (mdi-prepare; checked there, in one line)."""
    from mdi.model.layout import INT4_GROUPS, QUANT_MODES
    text = ("weights in memory, on disk and on the wire: none (float), int8, int4, or auto (the "
            "default: a GGUF's own precision class, Q8_0 -> int8, Q4_* -> int4; float stays float)")
    if gguf_types:
        from mdi.model.layout import EXPORT_TYPES
        p.add_argument("--quant", metavar="MODE", help=text + "; or a GGUF type for model.gguf (%s), the torch "
                       "weights then read back from it" % ", ".join(EXPORT_TYPES))
    else:
        p.add_argument("--quant", type=quant_mode, metavar="{%s}" % ",".join(QUANT_MODES), help=text)
    p.add_argument("--group-size", type=arg_type(int, lambda v: v >= 2, "an integer >= 2"), metavar="G",
                   help="with --quant int8/int4: values sharing one scale (int4: %s, default 32; int8: default "
                        "one scale per output channel)" % "/".join(str(g) for g in INT4_GROUPS))


def add_kernel_argument(p: argparse.ArgumentParser) -> None:
    from mdi.model.torch_settings import POLICY_NAMES
    p.add_argument("--quant-kernel", choices=POLICY_NAMES, metavar="POLICY",
                   help="how quantized layers multiply (runtime.quant_kernel): fast (default: the fastest kernel "
                        "measured on each layer's shape here: bfloat16 packed or int8 integer kernels, ~1%% logit "
                        "error), exact (float32 maths only, the same numbers as the dequantized model, several "
                        "times slower), or a kernel: " + ", ".join(POLICY_NAMES[2:]))
