"""The LeNet-style ConvNet of the classic data-parallel tutorials.

One definition serves 1x28x28 (MNIST) and 3x32x32 (CIFAR-10) inputs: 28-pixel images get
2 pixels of padding on the first convolution, as in LeCun's LeNet-5, so both reach 16x5x5.
Unlike the tutorials it ends in logits, not softmax: CrossEntropyLoss applies log-softmax itself.
"""

from torch import nn


class LeNet(nn.Module):
    def __init__(self, in_channels: int = 1, image_size: int = 28, num_classes: int = 10):
        super().__init__()
        if not 8 <= image_size <= 32:
            raise ValueError(f"LeNet takes images of 8 to 32 pixels, got {image_size}; resize the data")
        pad = (32 - image_size) // 2
        side = ((image_size + 2 * pad - 4) // 2 - 4) // 2
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, kernel_size=5, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(16 * side * side, 120), nn.ReLU(),
            nn.Linear(120, 84), nn.ReLU(),
            nn.Linear(84, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.features(x))


def lenet(input_shape: tuple = (1, 28, 28), num_classes: int = 10) -> nn.Module:
    if len(input_shape) != 3 or input_shape[1] != input_shape[2]:
        raise ValueError(f"LeNet needs square images shaped (C, H, W), got {tuple(input_shape)}")
    return LeNet(in_channels=input_shape[0], image_size=input_shape[1], num_classes=num_classes)
