"""Speculative decoding: a cheap draft proposes K tokens, one call of the target verifies them all,
and `Sequence.truncate` keeps the accepted ones. Then the same tokens decoded one at a time, to
check that what speculation kept is what plain decoding builds, bit for bit.

    python examples/speculative.py                        # the built-in tiny model
    python examples/speculative.py --model model.gguf     # any DeepSeek-V4.1 GGUF
    python examples/speculative.py --draft 5 --tokens 32  # drafts of 5, 32 tokens generated

The draft is prompt lookup: the K tokens that followed the latest earlier occurrence of the
context's last two tokens (or last one), else the last token repeated. One step: the target runs
the pending token and the K drafted ones in one call (K + 1 tokens) and, at each position, picks
its own next token; the draft's tokens are accepted while they agree with those picks; the
sequence is truncated to the pending token and the accepted ones (nothing to do when all K are
accepted), and the target's pick after the last accepted token is the next pending token. The
truncate restores the checkpoint the verify call left and runs the kept tokens again in one call
(flashv41.sequence_state), so the kept state is that of a sequence that ran them in one call.

The engine stops at the last layer's highway (no MoE, no LM head), so the target's pick is a
stand-in head: the greedy token of the highway's mean over its hc copies against the token
embedding (tied weights), the same function for both runs. What the example checks does not depend
on it: the same tokens come out of both runs, and the states are equal, array for array.

Bit for bit needs like with like: on a GPU a product's sums depend on the call's token count
(the stream kernel for up to 8 tokens, tensor cores past that), so a verify call of K + 1 <= 8
tokens computes each position as a decode step does (K is at most 7 here). On the simulator, with
the defaults on the tiny model: 40-80 s on two cores.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np

import flashv41
from flashv41.cli import guarded
from flashv41.host import gguf_layout as L
from flashv41.runner import backend_description, open_model, random_tokens

MAX_DRAFT = 7  # a verify call of K + 1 <= 8 tokens runs the decode step's kernels


class StandInHead:
    """The greedy next token of a highway row: argmax over the vocabulary of E @ mean_c(h[c]), E the
    token embedding (float32 [vocab, dim]): a stand-in for the LM head this engine does not run."""

    def __init__(self, model: flashv41.Model):
        self.embedding = model.tensor(None, L.TOKEN_EMBD).dequantize()

    def __call__(self, h: np.ndarray) -> list[int]:
        """h [T, hc, dim] -> T token ids."""
        return [int(i) for i in np.argmax(h.mean(axis=1) @ self.embedding.T, axis=1)]


def lookup_draft(context: list[int], k: int) -> list[int]:
    """K tokens after the latest earlier occurrence of the context's last two tokens (else last
    one), padded with the last token; the last token K times where neither occurs."""
    for n in (2, 1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == tail:
                follow = context[start + n:start + n + k]
                return follow + [follow[-1] if follow else context[-1]] * (k - len(follow))
    return [context[-1]] * k


def speculate(seq: flashv41.Sequence, head: StandInHead, pending: int, count: int, k: int) -> dict:
    """Generate `count` tokens after the sequence's, `pending` the target's pick for the next one:
    drafts of k verified in one call each, the rejected tail truncated away."""
    context = seq.tokens.tolist()
    generated: list[int] = []
    calls = drafted = accepted = rerun = 0
    while len(generated) < count:
        draft = lookup_draft(context + [pending], k)
        start = seq.position
        picks = head(seq.prefill([pending, *draft]))  # the target's next token after each of the K + 1
        calls += 1
        a = 0
        while a < k and draft[a] == picks[a]:
            a += 1
        kept = [pending, *draft[:a]][:count - len(generated)]
        if start + len(kept) < seq.position:
            rerun += len(kept)  # the kept tokens run again after the restore (sequence_state)
            seq.truncate(start + len(kept))
        generated += kept
        context += kept
        drafted += k
        accepted += min(a, len(kept) - 1)
        pending = picks[len(kept) - 1]
    return {"tokens": generated, "calls": calls, "drafted": drafted, "accepted": accepted, "rerun": rerun}


def plain(seq: flashv41.Sequence, head: StandInHead, pending: int, count: int) -> list[int]:
    """Greedy decoding, one token a step."""
    out = []
    for _ in range(count):
        out.append(pending)
        pending = head(seq.decode(pending))[0]
    return out


def state_differences(a: flashv41.Sequence, b: flashv41.Sequence) -> list[str]:
    """The arrays in which two sequences' states differ, bit for bit."""
    out = [] if np.array_equal(a.tokens, b.tokens) else ["tokens"]
    if a.hasher is not None and b.hasher is not None and not np.array_equal(a.hasher.history, b.hasher.history):
        out.append("hash history")
    for i, (sa, sb) in enumerate(zip(a.attention_state(), b.attention_state(), strict=True)):
        out += [f"layer {i} {name}" for name in sa if not np.array_equal(sa[name].view(np.uint32),
                                                                         sb[name].view(np.uint32))]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a DeepSeek-V4.1 GGUF (default: the built-in tiny model)")
    parser.add_argument("--prompt-len", type=int, default=8, help="prompt tokens, a random run of half of them "
                        "said twice (default 8)")
    parser.add_argument("--tokens", type=int, default=6, help="tokens to generate (default 6)")
    parser.add_argument("--draft", type=int, default=3, help=f"drafted tokens a verify call, 1..{MAX_DRAFT} "
                        "(default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt (default 0)")
    args = parser.parse_args(argv)
    if args.prompt_len < 2 or args.tokens < 1 or not 1 <= args.draft <= MAX_DRAFT:
        parser.error(f"--prompt-len must be at least 2, --tokens at least 1, --draft 1..{MAX_DRAFT}")

    warnings.filterwarnings("ignore", message=".*GPU under-utilization")
    print(f"kernels on: {backend_description()}")
    model = open_model(args.model)
    try:
        cfg = model.config
        half = random_tokens(cfg.vocab_size, (args.prompt_len + 1) // 2, args.seed, 0)
        prompt = np.concatenate([half, half])[:args.prompt_len]  # something for the lookup to find
        print(f"model: {model.path} ({cfg.describe()})")
        print(f"prompt: {prompt.size} tokens; draft: prompt lookup, K = {args.draft}; target's pick: a stand-in "
              "head (greedy against the token embedding; the engine has no LM head)")
        head = StandInHead(model)
        max_seq = prompt.size + args.tokens + args.draft + 1
        with flashv41.Engine(model, max_seq=max_seq, max_tokens=min(256, max_seq)) as engine:
            fast, slow = engine.new_sequence(), engine.new_sequence()
            pending = head(fast.prefill(prompt))[-1]
            slow.prefill(prompt)
            spec = speculate(fast, head, pending, args.tokens, args.draft)
            n = len(spec["tokens"])
            rate = spec["accepted"] / spec["drafted"]
            print(f"speculative: {n} tokens in {spec['calls']} verify calls ({n / spec['calls']:.2f} tokens a "
                  f"call), {spec['accepted']} of {spec['drafted']} drafted tokens accepted ({rate:.1%}); "
                  f"{spec['rerun']} kept tokens run again by truncates")
            reference = plain(slow, head, pending, args.tokens)
            print(f"plain decoding: {len(reference)} tokens in {len(reference)} decode steps")
            same_tokens = reference == spec["tokens"]
            print(f"same tokens: {'yes' if same_tokens else 'NO'} {spec['tokens']}")
            diff = state_differences(fast, slow)
            print("kept state equals plain decoding: " + (
                f"bit for bit (positions 0..{fast.position - 1}: rings, partial groups, caches, hash history)"
                if not diff else f"NO, differs in {', '.join(diff)}"))
        return 0 if same_tokens and not diff else 1
    finally:
        model.close()


if __name__ == "__main__":
    sys.exit(guarded("speculative.py", main))
