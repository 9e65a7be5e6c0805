"""Generation from a stage-3 sharded Hugging Face model: generate() gathers each unit
once per call (not once per token), within a budget if you give one, and returns the
unsharded model's tokens; then the weights streamed into a stand-in inference engine.

    torchrun --nproc-per-node 2 examples/generate_stage3.py [--budget 2MiB]

(Random weights: a tiny GPT-2 built from a config, no download.)
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import transformers

import zeroshard


class InferenceEngine:
    """A stand-in for an inference server's model runner: it loads (name, tensor) pairs."""

    def __init__(self, config: transformers.GPT2Config) -> None:
        self.model = transformers.GPT2LMHeadModel(config).eval()

    def load_weights(self, weights) -> None:
        params = dict(self.model.state_dict(keep_vars=True))
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", default=None,
                        help="gathered weights generate() keeps for the whole call, e.g. 2MiB")
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=512,
                                     n_positions=128, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    reference = transformers.GPT2LMHeadModel(config)
    reference.load_state_dict(model.state_dict())  # the unsharded model, for comparison
    model, optimizer = zeroshard.shard(model, torch.optim.AdamW, stage=3, lr=1e-4,
                                       generate_budget=args.budget)
    model.eval()
    prompt = torch.randint(1, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                  do_sample=False, pad_token_id=0)
    tokens = model.generate(prompt, **kwargs)  # a collective: every rank calls it
    # generate()'s collectives, in the ledger's own window for it (not a training step's)
    window = zeroshard.engine_of(model).comm.ledger.windows["generate"]
    gathers = sum(1 for r in window if r.op == "all_gather")
    same = torch.equal(tokens, reference.eval().generate(prompt, **kwargs))

    # Pushing the weights into an inference engine (vLLM's load_weights(iterator) shape):
    # one collective per unit, about one unit of extra memory; every rank iterates.
    engine = InferenceEngine(config)
    engine.load_weights(zeroshard.stream_weights(model, to_rank=0))
    if dist.get_rank() == 0:
        same = same and torch.equal(engine.model.generate(prompt, **kwargs), tokens)

    # Reading or editing whole weights between steps: keep every unit gathered.
    model.unshard()
    model.eval()
    with torch.no_grad():
        model(prompt)  # no gathers: the units are resident
    model.reshard()

    if dist.get_rank() == 0:
        units = len(zeroshard.engine_of(model).units)
        print(f"generate(): {gathers} all-gathers for {args.new_tokens} tokens over {units} "
              f"units; the unsharded model's tokens (and the inference engine's after "
              f"stream_weights): {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
