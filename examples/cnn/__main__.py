"""Train a CNN with gradsparse: `torchrun --standalone --nproc-per-node=4 -m examples.cnn`.

Defaults: the small CNN on Fashion-MNIST, 4 Gloo workers, plain DDP (dense all-reduce) then
Top-k at density 0.01, 2 epochs each; per-epoch loss, test accuracy, achieved density and bytes
sent, and a summary table.
"""

from examples import driver
from examples.cnn.data import fashion_mnist
from examples.cnn.models import SmallCNN


def fashion_mnist_task(args) -> driver.Task:
    x_train, y_train, x_test, y_test = fashion_mnist(args.data_dir)
    return driver.Task(
        name="SmallCNN on Fashion-MNIST",
        build_model=lambda: SmallCNN(in_channels=1, num_classes=10, image_size=28),
        train_inputs=x_train,
        train_targets=y_train,
        test_inputs=x_test,
        test_targets=y_test,
    )


if __name__ == "__main__":
    driver.main(fashion_mnist_task, description=__doc__)
