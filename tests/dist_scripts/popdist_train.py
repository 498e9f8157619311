"""A PopTorch program written as Graphcore's applications are: plain
``import poptorch`` / ``import popdist``, options from
``popdist.poptorch.Options()`` under poprun, a checkpoint written by
instance 0 only.  Run by tests/test_popdist.py under
``python -m poptorchsim.run``, with no poptorchsim import.

    python popdist_train.py OUT [--fail-on-instance I]

Each step trains on one global batch of ``total replicas * MICRO * GA``
seeded samples, laid out [accumulation step, replica, micro-batch]; each
instance takes the columns of its replicas (``getReplicaIndexOffset()``),
so every weight update sums the same micro-batches whatever the number of
instances.  With ``--fail-on-instance I``, instance I raises on its second
step, while the others wait for its gradients.
"""
import argparse
import json

import popdist
import popdist.poptorch
import poptorch
import torch
from torch import nn

MICRO, GA, STEPS = 2, 2, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 8), nn.Linear(8, 3)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels):
        out = self.fc2(torch.relu(self.fc1(x)))
        return out, self.loss(out, labels)


def global_batch(step, total_replicas):
    g = torch.Generator().manual_seed(100 + step)
    n = GA * total_replicas * MICRO
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def my_part(t, total_replicas):
    """The samples of this instance's replicas, laid out [GA, local, MICRO]."""
    first, local = popdist.getReplicaIndexOffset(), popdist.getNumLocalReplicas()
    t = t.reshape(GA, total_replicas, MICRO, *t.shape[1:])[:, first:first + local]
    return t.reshape(-1, *t.shape[3:])


def save(model, out):
    torch.save(model.state_dict(), out)
    with open(str(out) + ".json", "w") as f:
        json.dump({"instances": popdist.getNumInstances(),
                   "replicas": popdist.getNumTotalReplicas()}, f)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--fail-on-instance", type=int, default=None)
    args = parser.parse_args()
    if popdist.isPopdistEnvSet():
        popdist.init()
        opts = popdist.poptorch.Options()
        total = popdist.getNumTotalReplicas()
    else:
        total = 1
        opts = poptorch.Options().replicationFactor(total)
    opts.Training.gradientAccumulation(GA)
    opts.outputMode(poptorch.OutputMode.All)
    opts.showCompilationProgressBar(False)
    torch.manual_seed(0)
    model = Net()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    training = poptorch.trainingModel(model, opts, optimizer=optimizer)
    for step in range(STEPS):
        if step == 1 and popdist.getInstanceIndex() == args.fail_on_instance:
            raise ValueError(f"instance {args.fail_on_instance} fails here on purpose")
        x, labels = (my_part(t, total) for t in global_batch(step, total))
        _, loss = training(x, labels)
    training.copyWeightsToHost()
    popdist.execute_on_instances({0}, save, model, args.out)
    print(f"instance {popdist.getInstanceIndex()} of {popdist.getNumInstances()}: "
          f"{STEPS} steps, {opts.replication_factor} local replicas, "
          f"loss {float(loss.mean()):.4f}")


if __name__ == "__main__":
    main()
