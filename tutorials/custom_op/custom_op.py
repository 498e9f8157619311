"""Custom op tutorial: Poplar's "AdderVertex" as a poptorchsim custom op.

Graphcore's first Poplar example is a vertex that adds two numbers::

    class AdderVertex : public Vertex {
    public:
      Input<float> x;
      Input<float> y;
      Output<float> sum;
      bool compute() { *sum = x + y; return true; }
    };

One vertex per element adds two vectors.  In PopTorch such code becomes a
PopART custom op, called with ``poptorch.custom_op``.  In poptorchsim the op
is written in Python and registered with the cost its vertex would have:
``x + y`` takes a worker a load of each input, an add and a store, about
four cycles per element.  The script runs the op inside an inference model
and a training model, compares both with PyTorch, and prints what the
simulated IPU spends on it.

    python tutorials/custom_op/custom_op.py
"""
import copy

import torch

import poptorchsim as poptorch

CYCLES_PER_ELEMENT = 4       # load x, load y, add, store


@poptorch.register_custom_op("AdderVertex", domain="tutorial", domain_version=1,
                             cycles_per_element=CYCLES_PER_ELEMENT)
def adder(x, y):
    """The vertex's ``*sum = x + y``, for every element."""
    return x + y


class AddVectors(torch.nn.Module):
    """Adds two vectors with the custom op."""

    def forward(self, x, y):
        total, = poptorch.custom_op([x, y], "AdderVertex", "tutorial", 1, example_outputs=[x])
        return total


class Trainable(torch.nn.Module):
    """A linear layer whose output the custom op adds to a learned bias
    vector: training differentiates through the op (by PyTorch's autograd
    of ``adder``, as no backward was registered)."""

    def __init__(self, n=64):
        super().__init__()
        self.fc = torch.nn.Linear(n, n)
        self.bias = torch.nn.Parameter(torch.zeros(n))

    def forward(self, x, target):
        out, = poptorch.custom_op([self.fc(x), self.bias.expand_as(x)], "AdderVertex",
                                  "tutorial", 1, example_outputs=[x])
        return out, torch.nn.functional.mse_loss(out, target)


def main():
    opts = poptorch.Options().showCompilationProgressBar(False)
    x, y = torch.arange(1024.0), torch.full((1024,), 0.5)
    model = poptorch.inferenceModel(AddVectors(), opts)
    total = model(x, y)
    assert torch.equal(total, x + y)
    row = next(r for r in model.simulationReport()["ops"] if r["class"] == "custom")
    print(f"inference: sum of 1024-element vectors matches PyTorch; the custom op costs "
          f"{row['cycles']:.0f} cycles ({row['compute']:.0f} compute)")

    torch.manual_seed(0)
    net = Trainable()
    reference = copy.deepcopy(net)
    data, target = torch.randn(8, 64), torch.randn(8, 64)
    trainer = poptorch.trainingModel(net, opts,
                                     optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        _, loss = trainer(data, target)
        optimizer.zero_grad()
        _, ref_loss = reference(data, target)
        ref_loss.backward()
        optimizer.step()
    diff = max((a - b).abs().max().item()
               for a, b in zip(net.parameters(), reference.parameters()))
    print(f"training: loss {float(loss):.4f} (PyTorch {ref_loss.item():.4f}), largest weight "
          f"difference after 3 steps {diff:.2e}")
    rows = [r for r in trainer.simulationReport()["ops"] if r["class"] == "custom"]
    for r in sorted(rows, key=lambda r: r["name"]):
        print(f"  {r['name']}: {r['cycles']:.0f} cycles")
    assert diff < 1e-5


if __name__ == "__main__":
    main()
