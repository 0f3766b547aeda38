"""mdi-train: train a LoRA (or, --method prompt, a soft prompt) through the ring of a YAML
config (the workers and config inference uses), write it as a PEFT adapter directory that
`mdi-start --adapter` / `adapters:` serve."""
import argparse
import os
import signal
import sys
from typing import List, Optional

from mdi.cli.arguments import ArgumentParser, positive_float, positive_int
from mdi.cli.output import check_output
from mdi.cli.process import EXIT_CONFIG, EXIT_RUN, fail, interrupt_on_sigterm, setup_process, stopped
from mdi.model.layout import CheckpointError
from mdi.model.tokenizers import TokenizerError
from mdi.runconfig import ConfigError, RunConfig, load_config
from mdi.system.files import write_json

LORA_DEFAULTS = {"rank": 8, "alpha": 16.0, "targets": "q,k,v,o,gate,up,down"}  # --method lora's flags
PROMPT_DEFAULTS = {"num_virtual_tokens": 8, "prompt_init": "random"}  # --method prompt's flags


def train_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="mdi-train",
        description="Fine-tune a LoRA on the ring of a run config: the base stays frozen where it is, each "
                    "node trains the adapter of its own layers; or (--method prompt) a soft prompt on the starter "
                    "(see README 'mdi-train').",
        epilog="Example: mdi-train --config configs/ring3.yaml --data play.txt --steps 100 --out my-lora")
    p.add_argument("--config", required=True, help="run configuration (YAML), the one mdi-start uses")
    p.add_argument("--data", required=True, metavar="FILE",
                   help="UTF-8 text: window k is tokens [k L, (k+1) L) of the whole file's ids (no BOS); every "
                        "window's L-1 next-token predictions are scored. A .jsonl file: one example per line and "
                        'window, {"prompt", "completion"} (the completion and an EOS scored) or {"messages": [...]} '
                        "(the assistant turns scored, the model's chat template), truncated or padded to --seq-len")
    p.add_argument("--method", default="lora", choices=["lora", "prompt"],
                   help="lora: every node trains a LoRA of its layers; prompt: prompt tuning, virtual tokens "
                        "trained on the starter, the whole base frozen (default lora)")
    # (the two methods' flags are None until resolved: the other method refuses them given, where they would
    # change nothing)
    p.add_argument("--num-virtual-tokens", type=positive_int, metavar="N",
                   help="--method prompt: virtual tokens put before every window (default %s)"
                   % PROMPT_DEFAULTS["num_virtual_tokens"])
    p.add_argument("--prompt-init", choices=["random", "text"],
                   help="--method prompt: the virtual tokens start as N(0, 1) drawn from --seed, or as the "
                        "embeddings of --prompt-init-text's tokens, repeated or cut to N (PEFT's PromptTuningInit; "
                        "default %s)" % PROMPT_DEFAULTS["prompt_init"])
    p.add_argument("--prompt-init-text", metavar="TEXT", help="the text --prompt-init text starts from")
    p.add_argument("--rank", type=positive_int, help="LoRA rank r (default %s)" % LORA_DEFAULTS["rank"])
    p.add_argument("--alpha", type=positive_float, help="LoRA alpha; the scale is alpha / r (default %s)"
                   % LORA_DEFAULTS["alpha"])
    p.add_argument("--targets",
                   help="modules to adapt, of q,k,v,o,gate,up,down (GPT-2: q/k/v are c_attn, gate/up c_fc, "
                        "down the MLP's c_proj; default all)")
    p.add_argument("--steps", type=positive_int, default=10, help="optimizer steps (default 10)")
    p.add_argument("--batch-size", type=positive_int, default=4, help="windows per step B (default 4)")
    p.add_argument("--micro-batches", type=positive_int, default=None,
                   help="micro-batches a step's batch travels as, so every node is busy (default: twice the "
                        "number of nodes, at most B: measured faster than once, README); the gradients are those "
                        "of the whole batch")
    p.add_argument("--seq-len", type=positive_int, default=128, help="window length L in tokens (default 128)")
    p.add_argument("--lr", type=positive_float, default=1e-4, help="AdamW learning rate (default 1e-4; betas "
                                                                    "0.9/0.999, eps 1e-8, weight decay 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the LoRA's initialisation (default 0)")
    p.add_argument("--recompute", action="store_true",
                   help="nodes keep only each micro-batch's input and run its forward again for backward "
                        "(less memory, one more forward)")
    p.add_argument("--out", metavar="DIR",
                   help="write the trained adapter here (PEFT format; without it the adapter is not kept)")
    p.add_argument("--metrics-out", metavar="FILE.json", help='write {"steps": [{"step", "loss", "tokens_per_s"}], ...}')
    p.add_argument("--init-adapter", metavar="DIR",
                   help="start from this PEFT LoRA (its rank, alpha and modules replace --rank, --alpha, --targets); "
                        "with --method prompt, from this prompt-tuning adapter (its virtual tokens replace "
                        "--num-virtual-tokens)")
    p.add_argument("--checkpoint-every", type=positive_int, metavar="K",
                   help="every K steps write OUT/checkpoint-<step>: the adapter, every node's AdamW state, the "
                        "step and data position (needs --out)")
    p.add_argument("--resume", metavar="DIR", help="go on from a checkpoint of this same run (--steps is the total)")
    p.add_argument("--eval", metavar="FILE", help="held-out data (as --data): its mean loss before training, every "
                                                 "--eval-every steps and at the end, in --metrics-out's \"eval\"")
    p.add_argument("--eval-every", type=positive_int, metavar="K", help="steps between evaluations (default: "
                                                                       "--checkpoint-every, else only at the end)")
    p.add_argument("--shuffle", action="store_true", help="each epoch's windows in an order drawn from --seed")
    p.add_argument("--recovery-every", type=positive_int, default=1, metavar="K",
                   help="with recovery on (spares, or runtime.recovery_attempts): the starter keeps every node's "
                        "trainable state every K steps, so a lost worker costs at most K steps redone "
                        "(default 1)")
    p.add_argument("--clip", type=positive_float, metavar="X",
                   help="scale the batch's gradients so their global norm, over every node's parameters, is at "
                        "most X (torch.nn.utils.clip_grad_norm_)")
    return p


def train_main(argv: Optional[List[str]] = None) -> int:
    args = train_parser().parse_args(argv)
    from mdi.ring.auth import TokenError, load_token
    from mdi.starter import batch
    from mdi.starter.train import training
    from mdi.ring.train_request import TrainSetup
    from mdi.model.adapters.lora import AdapterError
    from mdi.model.adapters.lora_train import check_targets, read_peft_pairs, save_peft_adapter
    from mdi.model.adapters.prompt_train import PromptSpec, read_prompt_adapter, save_prompt_adapter
    from mdi.model.source import ModelSource
    from mdi.starter.train.train_checkpoint import load_checkpoint

    previous = interrupt_on_sigterm(batch.Interrupted)
    try:
        prompt_method = args.method == "prompt"
        if (args.prompt_init == "text") != bool(args.prompt_init_text) or (args.prompt_init_text and not prompt_method):
            raise ConfigError("--prompt-init-text goes with --method prompt --prompt-init text, and they need it")
        _resolve_method_flags(args, prompt_method)
        if args.eval_every and not args.eval:
            raise ConfigError("--eval-every goes with --eval FILE (the held-out data it evaluates)")
        check_output(args.out, "--out", folder=True)  # before training, whose result would be lost
        check_output(args.metrics_out, "--metrics-out")
        cfg = load_config(args.config)
        if args.out:
            _check_out(args.out, cfg, args.resume)
        if args.metrics_out:
            _check_metrics_out(args, cfg)
        cfg.runtime.token = load_token(cfg.runtime.token_file)
        setup_process(threads=cfg.runtime.threads)
        try:
            targets = check_targets([t.strip() for t in args.targets.split(",") if t.strip()])
        except ValueError as e:
            raise ConfigError(str(e))
        source = ModelSource(cfg.model.path)
        pairs, prompt, prompt_spec, text_ids = None, None, None, None
        rank, alpha = args.rank, args.alpha
        if prompt_method:
            targets = ()  # no node trains a LoRA: the prompt is the starter's (mdi.model.adapters.prompt_train)
            n_virtual = args.num_virtual_tokens
            if args.init_adapter:
                prompt = read_prompt_adapter(args.init_adapter, source.config)
                n_virtual = int(prompt.shape[0])
            prompt_spec = PromptSpec(n_virtual, args.prompt_init, args.prompt_init_text)
            if args.prompt_init_text and prompt is None:
                if source.tokenizer is None:
                    raise ConfigError("--prompt-init text: the model %s has no tokenizer" % cfg.model.path)
                text_ids = source.tokenizer.encode(args.prompt_init_text)  # as PEFT's tokenizer(text): BOS too
        elif args.init_adapter:
            spec, pairs = read_peft_pairs(args.init_adapter, source.config)
            targets, rank, alpha = spec.targets, spec.rank, spec.alpha
        setup = TrainSetup(targets=targets, rank=rank, alpha=alpha, lr=args.lr, recompute=args.recompute)
        micro = args.micro_batches or min(2 * len(cfg.nodes), args.batch_size)
        options = training.TrainOptions(
            args.data, setup, steps=args.steps, batch_size=args.batch_size, micro_batches=micro, seq_len=args.seq_len,
            seed=args.seed, shuffle=args.shuffle, clip=args.clip, eval_data=args.eval,
            eval_every=args.eval_every or args.checkpoint_every, checkpoint_every=args.checkpoint_every,
            checkpoint_dir=args.out, recovery_every=args.recovery_every,
            # only chat JSONL reads the template (plain text had said serving's warning of a model without one)
            render_chat=chat_renderer(source.tokenizer, cfg.serve.chat_template) if source.tokenizer and any(
                (path or "").endswith(".jsonl") for path in (args.data, args.eval)) else None,
            prompt=prompt_spec)
        resume = load_checkpoint(args.resume, source.config, training.fingerprint(cfg, options)) \
            if args.resume else None
        result = training.run(cfg, options, on_step=_print_step, pairs=pairs, resume=resume, prompt=prompt,
                              prompt_text_ids=text_ids)
        if args.out and result.prompt is not None:
            assert prompt_spec is not None
            save_prompt_adapter(args.out, source.config, prompt_spec, result.prompt, cfg.model.path)
        elif args.out:
            save_peft_adapter(args.out, source.config, setup.spec, result.pairs, cfg.model.path)
        if args.metrics_out:
            write_json(args.metrics_out, result.metrics())
    except (ConfigError, CheckpointError, TokenizerError, TokenError, AdapterError) as e:
        return fail(str(e), EXIT_CONFIG)
    except (KeyboardInterrupt, batch.Interrupted) as e:
        return stopped(e)
    except RuntimeError as e:
        return fail(str(e), EXIT_RUN)
    finally:
        signal.signal(signal.SIGTERM, previous)
    last = result.steps[-1]
    print("mdi-train: %d steps, final loss %.4f, %.1f tokens/s, %d nodes%s"
          % (len(result.steps), last.loss, last.tokens_per_s, result.n_nodes,
             ", adapter in %s" % args.out if args.out else ""))
    if not args.out:
        print("mdi-train: no --out given: the trained adapter was not written", file=sys.stderr)
    return 0


def _resolve_method_flags(args: argparse.Namespace, prompt_method: bool) -> None:
    """Refuse the other method's flags (they would change nothing), then fill this method's defaults."""
    own, other = (PROMPT_DEFAULTS, LORA_DEFAULTS) if prompt_method else (LORA_DEFAULTS, PROMPT_DEFAULTS)
    given = [flag for flag in other if getattr(args, flag) is not None]
    if given:
        raise ConfigError("--%s goes with --method %s, and --method %s trains %s" % (
            given[0].replace("_", "-"), "lora" if prompt_method else "prompt", args.method,
            "a soft prompt (no LoRA)" if prompt_method else "a LoRA (no soft prompt)"))
    for flag, default in {**LORA_DEFAULTS, **PROMPT_DEFAULTS}.items():
        if getattr(args, flag) is None:
            setattr(args, flag, default)


def _check_out(out: str, cfg: RunConfig, resume: Optional[str]) -> None:
    """--out must not overwrite what a run reads or serves: the model's folder, a configured
    adapter's, or an adapter already there (it was replaced without a word), unless that is
    this run's own, resumed from one of its checkpoints there."""
    from mdi.model.adapters.adapter_files import CONFIG_FILE, WEIGHTS_FILE
    from mdi.serving.served_files import ServedFiles
    real = os.path.realpath(out)
    clash = ServedFiles(cfg.model.path, cfg.adapters).clash(real)
    if clash is not None:
        raise ConfigError("--out %s %s: training must not write over the files runs read" % (out, clash))
    if resume is not None and os.path.commonpath([os.path.realpath(resume), real]) == real:
        return
    held = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if os.path.exists(os.path.join(out, f))]
    if held:
        raise ConfigError("--out %s already holds an adapter (%s): name a new folder, or move it away first"
                          % (out, held[0]))


def _check_metrics_out(args: argparse.Namespace, cfg: RunConfig) -> None:
    """--metrics-out must not overwrite what the run reads: the model's or an adapter's files,
    its config, its data or its chat template (each was replaced by the metrics record: h67)."""
    from mdi.serving.served_files import ServedFiles
    real = os.path.realpath(args.metrics_out)
    clash = ServedFiles(cfg.model.path, cfg.adapters).clash(real)
    read = [p for p in (args.config, args.data, args.eval, cfg.serve.chat_template, args.resume, args.init_adapter)
            if p and os.path.realpath(p) == real]
    if clash is not None or read:
        raise ConfigError("--metrics-out %s %s: name another file" % (args.metrics_out, clash or "is read by this run"))


def _print_step(record, total: int) -> None:
    """One line per step: step, loss, tokens/s, ETA."""
    eta = record.seconds * (total - record.step - 1)
    print("step %d/%d  loss %.4f  %.1f tokens/s  eta %.0f s" % (record.step + 1, total, record.loss,
                                                               record.tokens_per_s, eta), file=sys.stderr, flush=True)


def chat_renderer(tokenizer, template_path: Optional[str] = None):
    """A chat example's pieces of text, the assistant turns marked scored (mdi.starter.train.train_data):
    the model's chat template (serving's sandboxed one) renders the conversation up to each
    assistant turn with the generation prompt, and through it without; the turn is what the
    second adds to the first. A template whose renderings are not each other's prefixes (one that
    rewrites earlier turns) is refused for that example. `template_path`: serve.chat_template, as
    the server renders with it."""
    from mdi.serving.prompts import MAX_TEMPLATE_SECONDS, ChatTemplate
    from mdi.system.interrupt import thread_deadline
    chat = ChatTemplate.of_config(tokenizer, template_path)

    def render(messages, generation_prompt):
        try:  # bounded in time as serving bounds it (the template is the model file's code)
            with thread_deadline(MAX_TEMPLATE_SECONDS):
                text = "".join(chat.template.generate(messages=messages, add_generation_prompt=generation_prompt,
                                                      bos_token=chat.bos, eos_token=chat.eos))
        except Exception as e:  # jinja's TemplateError, SecurityError, DeadlinePassed, the template's own raise
            raise ValueError("the chat template refused these messages: %s" % e)
        if tokenizer.add_bos and chat.bos and text.startswith(chat.bos):
            text = text[len(chat.bos):]  # the tokenizer adds BOS itself (as ChatTemplate.render)
        return text

    def pieces(messages):
        messages = [{"role": m.get("role"), "content": m.get("content")} for m in messages]
        for m in messages:
            if m["role"] not in ("system", "user", "assistant") or not isinstance(m["content"], str):
                raise ValueError("each message needs a role of system, user or assistant and a string content")
        whole = render(messages, False)
        out, at = [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before, through = render(messages[:i], True), render(messages[:i + 1], False)
            if not (through.startswith(before) and whole.startswith(through) and len(before) >= at):
                raise ValueError("the chat template does not render turn %d as a continuation of the turns before "
                                 "it, so its tokens cannot be told apart" % i)
            out += [(whole[at:len(before)], False), (whole[len(before):len(through)], True)]
            at = len(through)
        out.append((whole[at:], False))
        return [(text, scored) for text, scored in out if text]
    return pieces
