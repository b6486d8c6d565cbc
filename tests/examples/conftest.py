import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """The examples' small models run fastest on one thread (several spin-wait against each
    other on a busy machine). Modules opt in with pytest.mark.usefixtures."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
