"""Image classification with CNNs (the seeds' CNN benchmarks); Fashion-MNIST installs offline."""
