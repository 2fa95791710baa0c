"""A training script written for DeepSpeed, in the shape of DeepSpeed's CIFAR-10 tutorial, run by
shardlab with one line changed: ``import shardlab as deepspeed`` (docs/api.md, A DeepSpeed script
unchanged). With ``import deepspeed`` it is a DeepSpeed script again.

    shardlab launch --nproc 2 examples/deepspeed_unchanged.py --deepspeed_config examples/ds_config.json
    shardlab launch --nproc 2 examples/deepspeed_unchanged.py --deepspeed_config examples/ds_config.json \\
        --synthetic --limit 512 --epochs 2 --ckpt /tmp/ds-ckpt     # resumes from /tmp/ds-ckpt/latest

Fashion-MNIST (or random images with ``--synthetic``), the CNN of examples/deepspeed_cnn.py.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import shardlab as deepspeed  # the one line that differs from a DeepSpeed script
from deepspeed_cnn import Net, load  # examples/deepspeed_cnn.py, beside this file


def add_argument():
    parser = argparse.ArgumentParser(description="Fashion-MNIST, a DeepSpeed script")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--limit", type=int, default=4096, help="training images")
    parser.add_argument("--synthetic", action="store_true", help="random images instead of Fashion-MNIST")
    parser.add_argument("--ckpt", default=None, help="checkpoint directory: resume from it, save to it")
    parser.add_argument("--log-interval", type=int, default=20)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main():
    args = add_argument()
    torch.manual_seed(0)
    x, y = load("train", args.limit, args.synthetic)
    trainset = TensorDataset(x, y)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset)
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    first_epoch = 0
    if args.ckpt:
        path, client_sd = model_engine.load_checkpoint(args.ckpt)
        if path is not None:
            first_epoch = client_sd["epoch"] + 1
            if model_engine.global_rank == 0:
                print(f"resumed from {path} at epoch {first_epoch}", flush=True)
    for epoch in range(first_epoch, args.epochs):
        trainloader.data_sampler.set_epoch(epoch)
        running = 0.0
        for i, (inputs, labels) in enumerate(trainloader):
            inputs, labels = inputs.to(model_engine.device), labels.to(model_engine.device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = F.cross_entropy(outputs.float(), labels)
            model_engine.backward(loss)
            model_engine.step()
            running += loss.item()
            if model_engine.global_rank == 0 and (i + 1) % args.log_interval == 0:
                lr = lr_scheduler.get_last_lr()[0] if lr_scheduler is not None else optimizer.param_groups[0]["lr"]
                print(f"[{epoch + 1}, {i + 1:5d}] loss {running / args.log_interval:.3f} lr {lr:.2e}", flush=True)
                running = 0.0
        if args.ckpt:
            model_engine.save_checkpoint(args.ckpt, tag=f"epoch{epoch}", client_state={"epoch": epoch})
    if model_engine.global_rank == 0:
        print(f"done: {model_engine.global_steps} optimizer steps on {model_engine.world_size} ranks", flush=True)


if __name__ == "__main__":
    main()
