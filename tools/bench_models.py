"""torchvision's detection models, whole, with torchvision's kernels and
with ours behind its ops (mmdispatch.torch.replace_torchvision_kernels),
side by side in one run: what a user who adds that one line sees.

    python tools/bench_models.py [--device cpu|cuda] [--repeat 5] [--quick]

For Faster R-CNN and Mask R-CNN (ResNet-50 FPN, random weights, 91
classes; images of the COCO size the models resize to, 800 x 1216):
- inference on 2 images (eval, no gradient);
- a training step on 2 images with 8 ground-truth boxes (and masks)
  each: forward, the losses' backward.

Each row: the median seconds of the whole model with torchvision's kernels
and with ours, their ratio (torchvision / ours), and the same for the
modules that hold our kernels, timed by forward hooks: the RPN (its nms,
beside its head's convolutions and box coding) plus the ROI heads (poolers
and box nms, beside the box and mask heads' layers), forward only (the backward of a training step
runs in autograd's engine, outside any module's hooks). The backbone's
convolutions are torch's either way, so the whole-model ratio is bounded
by their share. The two sides run alternately, the same seeds, the same
inputs; the warm-up run of each is not counted.
"""
import argparse
import statistics
import time

import torch

import mmdispatch.torch as mt


def model_and_inputs(name, device, quick):
    from torchvision.models.detection import fasterrcnn_resnet50_fpn, maskrcnn_resnet50_fpn

    torch.manual_seed(0)
    size = (400, 608) if quick else (800, 1216)
    build = {"Faster R-CNN": fasterrcnn_resnet50_fpn, "Mask R-CNN": maskrcnn_resnet50_fpn}[name]
    model = build(weights=None, weights_backbone=None, min_size=size[0],
                  max_size=size[1]).to(device)
    g = torch.Generator().manual_seed(1)
    images = [torch.rand(3, *size, generator=g).to(device) for _ in range(2)]
    targets = []
    for _ in range(2):
        corner = torch.rand(8, 2, generator=g) * torch.tensor([size[1] * 0.7, size[0] * 0.7])
        side = torch.rand(8, 2, generator=g) * 250 + 16
        boxes = torch.cat([corner, corner + side], 1)
        masks = torch.zeros(8, *size, dtype=torch.uint8)
        for j, (x1, y1, x2, y2) in enumerate(boxes.int().tolist()):
            masks[j, y1:y2, x1:x2] = 1
        targets.append({"boxes": boxes.to(device), "labels": torch.randint(1, 91, (8,),
                                                                             generator=g).to(device),
                        "masks": masks.to(device)})
    return model, images, targets


class PartTimer:
    """Seconds spent inside the model's rpn and roi_heads forward."""

    def __init__(self, model, sync):
        self.total, self.sync, self.starts = 0.0, sync, {}
        for module in (model.rpn, model.roi_heads):
            module.register_forward_pre_hook(self.begin)
            module.register_forward_hook(self.end)

    def begin(self, module, args):
        self.sync()
        self.starts[id(module)] = time.perf_counter()

    def end(self, module, args, output):
        self.sync()
        self.total += time.perf_counter() - self.starts.pop(id(module))


def measure(name, device, repeat, quick):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    model, images, targets = model_and_inputs(name, device, quick)
    parts = PartTimer(model, sync)

    def inference():
        model.eval()
        with torch.no_grad():
            model(images)

    def training_step():
        model.train()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(2)   # the proposal sampler's draws, the same on both sides
        losses = model(images, targets)
        sum(losses.values()).backward()

    rows = []
    for label, fn in (("inference, 2 images", inference), ("training step, 2 images",
                                                             training_step)):
        times = {"torchvision": [], "ours": []}
        part_times = {"torchvision": [], "ours": []}
        for i in range(repeat + 1):
            for side in ("torchvision", "ours"):
                kernels = mt.replace_torchvision_kernels(devices=[device]) if side == "ours" \
                    else None
                try:
                    parts.total = 0.0
                    sync()
                    start = time.perf_counter()
                    fn()
                    sync()
                    if i:   # the first run of each side warms up
                        times[side].append(time.perf_counter() - start)
                        part_times[side].append(parts.total)
                finally:
                    if kernels is not None:
                        kernels.restore()
        row = {"model": name, "workload": label}
        for key, source in (("whole", times), ("rpn+roi_heads", part_times)):
            theirs, ours = (statistics.median(source[s]) for s in ("torchvision", "ours"))
            row[key] = (theirs, ours, theirs / ours)
        rows.append(row)
        print(f"{name}, {label}: whole model torchvision {row['whole'][0]:.3f} s, ours "
              f"{row['whole'][1]:.3f} s ({row['whole'][2]:.2f}x); rpn+roi_heads forward "
              f"{row['rpn+roi_heads'][0]:.3f} s vs {row['rpn+roi_heads'][1]:.3f} s "
              f"({row['rpn+roi_heads'][2]:.2f}x)", flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="400 x 608 images")
    parser.add_argument("--models", nargs="*", default=["Faster R-CNN", "Mask R-CNN"])
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, "
          f"median of {args.repeat}")
    for name in args.models:
        measure(name, args.device, args.repeat, args.quick)


if __name__ == "__main__":
    main()
