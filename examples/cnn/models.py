"""CNN models of the CNN benchmarks."""

from __future__ import annotations

import torch.nn as nn


class SmallCNN(nn.Module):
    """Two 5x5 convolutions and two linear layers (about 80 thousand parameters at 28 x 28)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        side = ((image_size - 4) // 2 - 4) // 2
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * side * side, 128), nn.ReLU(), nn.Linear(128, num_classes)
        )

    def forward(self, x):
        return self.classifier(self.features(x))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and an identity (or 1x1 projection) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.bn1(self.conv1(x)).relu()
        return (self.bn2(self.conv2(out)) + self.shortcut(x)).relu()


class ResNet(nn.Module):
    """ResNets for small images: a 3x3 stem (no max-pool), stages of basic blocks, global
    average pooling. ResNet-18: widths 64-512, blocks (2, 2, 2, 2), 11.2 M parameters at 10
    classes; ResNet-20: widths 16-64, blocks (3, 3, 3), 0.27 M parameters."""

    def __init__(self, widths, blocks, in_channels: int = 3, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]))
        layers, cin = [], widths[0]
        for i, (width, count) in enumerate(zip(widths, blocks, strict=True)):
            for j in range(count):
                layers.append(BasicBlock(cin, width, 2 if i > 0 and j == 0 else 1))
                cin = width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        out = self.layers(self.stem(x).relu())
        return self.fc(out.mean(dim=(2, 3)))


_VGG = {
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    19: [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"],
}


class VGG(nn.Module):
    """VGG-16/19 with batch norm for 32x32 images (one 512-wide linear layer on top)."""

    def __init__(self, depth: int, in_channels: int = 3, num_classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        cin = in_channels
        for v in _VGG[depth]:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(cin, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
                cin = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(512, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def build(name: str, in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    """A model by its command-line name."""
    if name == "smallcnn":
        return SmallCNN(in_channels, num_classes, image_size)
    if name == "resnet18":
        return ResNet((64, 128, 256, 512), (2, 2, 2, 2), in_channels, num_classes)
    if name == "resnet20":
        return ResNet((16, 32, 64), (3, 3, 3), in_channels, num_classes)
    if name in ("vgg16", "vgg19"):
        if image_size != 32:
            raise ValueError(f"--model {name} needs 32x32 images (CIFAR), got {image_size}x{image_size}")
        return VGG(int(name[3:]), in_channels, num_classes)
    raise ValueError(f"--model: unknown model {name!r}; choose from {', '.join(MODELS)}")


MODELS = ("smallcnn", "resnet18", "resnet20", "vgg16", "vgg19")
