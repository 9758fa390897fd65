"""A user's training program, run by tests/measure/test_live.py as 1 or 2 processes: a tiny Llama trained by the
transformers Trainer with `zeroplan.ZeroplanCallback()`, or by a plain loop (DDP on 2 ranks) under
`zeroplan.track(model, optimizer)`. It writes what zeroplan reported to --output as JSON.

    python tests/live_program.py --mode trainer|loop|accelerate|opaque --output OUT.json [--store FILE] [...]

With --store (two processes: RANK and WORLD_SIZE in the environment) the ranks join a gloo process
group through that file, on the loopback interface, as the measure workers do (NOTES: a TCP
rendezvous listens on every interface).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import warnings

import torch
import torch.distributed as dist

import zeroplan
from zeroplan.errors import ZeroplanError, ZeroplanWarning

# tiny-llama (model_specs/tiny-llama.toml) as a user writes its config
CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def __len__(self) -> int:
        return 256

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, CONFIG["vocab_size"], (self.seq_len,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}


def trainer(options) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), max_steps=options.steps + 1, per_device_train_batch_size=options.micro_batch,
        gradient_accumulation_steps=options.grad_accum, use_cpu=True, report_to="none",
        ddp_backend="gloo" if dist.is_initialized() else None,
        save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_pin_memory=False, seed=1234,
    )
    callback = zeroplan.ZeroplanCallback(steps=options.steps, gpu=options.gpu, strict=options.strict)
    Trainer(model=model, args=args, train_dataset=Tokens(options.seq_len), callbacks=[callback]).train()
    return {"report": callback.report, "measure_json": callback.tracker.to_dict()}


def loop(options) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tracker = zeroplan.track(model, optimizer, steps=options.steps, gpu=options.gpu)  # before DDP wraps the model
    wrapped = torch.nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model
    data = Tokens(options.seq_len)
    for step in range(options.steps + 1):  # the tracker's last step ends at the next forward
        rows = [data[(step * options.micro_batch + i) * max(1, dist.get_world_size() if dist.is_initialized() else 1)]
                for i in range(options.micro_batch)]
        batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
        loss = wrapped(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"report": tracker.report, "measure_json": tracker.to_dict()}


def accelerate_loop(options) -> dict:
    """accelerate's loop: the tracker before `prepare`, accumulation through `accumulate`."""
    from accelerate import Accelerator
    from transformers import LlamaConfig, LlamaForCausalLM

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=options.grad_accum)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    loader = torch.utils.data.DataLoader(Tokens(options.seq_len), batch_size=options.micro_batch)
    tracker = zeroplan.track(model, optimizer, steps=options.steps)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for index, batch in enumerate(loader):
        if index == (options.steps + 1) * options.grad_accum:
            break
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return {"report": tracker.report, "measure_json": tracker.to_dict()}


def opaque(options) -> dict:
    """A model zeroplan cannot describe (no Hugging Face config): one warning, training goes on."""
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with zeroplan.track(model, optimizer, steps=2) as tracker:
        for _ in range(4):
            ids = torch.randint(0, 64, (2, 8))
            loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return {"report": tracker.report, "steps_trained": len(losses)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("trainer", "loop", "accelerate", "opaque"), required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--store")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--gpu")
    parser.add_argument("--strict", action="store_true")
    options = parser.parse_args()
    if options.store:
        dist.init_process_group("gloo", init_method=f"file://{options.store}", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(1234)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            outcome = {"trainer": trainer, "loop": loop, "accelerate": accelerate_loop, "opaque": opaque}[options.mode](options)
        except ZeroplanError as error:
            outcome = {"error": f"{type(error).__name__}: {error}"}
    outcome["warnings"] = [str(w.message) for w in caught if issubclass(w.category, ZeroplanWarning)]
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(options.output.replace("{rank}", str(rank)), "w") as out:
        json.dump(outcome, out)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
