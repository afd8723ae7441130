"""Tensors with a math bit (lazy ``conj()`` / negation) on the native device, against a real server.

Before the fix a copy of such a tensor that involved remote_accelerator recursed in ATen's
Conjugate/Negative fallback (``_copy_from`` -> materialize with ``clone`` -> ``copy_`` ->
``_copy_from``) until the client process died with SIGSEGV. Each test covers one way a math bit
reaches a copy: reading it back, writing it to the device, between devices, into a destination
that has the bit, as the input of an op, and inside autograd's backward formulas.
"""

from __future__ import annotations

import pytest
import torch

D0 = "remote_accelerator:0"
D1 = "remote_accelerator:1"

pytestmark = pytest.mark.usefixtures("remote")


def _complex() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(3, 4, dtype=torch.complex64)


def test_a_conjugated_remote_tensor_comes_back_conjugated() -> None:
    x = _complex()
    y = x.to(D0).conj()
    assert y.is_conj()
    torch.testing.assert_close(y.cpu(), x.conj())
    torch.testing.assert_close(y.resolve_conj().cpu(), x.conj())
    torch.testing.assert_close(x.to(D0).mH.cpu(), x.mH)


def test_a_negative_bit_remote_tensor_comes_back_negated() -> None:
    x = _complex()
    imag = x.to(D0).conj().imag  # the imaginary part of a conjugate is a view with the negative bit
    assert imag.is_neg()
    torch.testing.assert_close(imag.cpu(), -x.imag)
    torch.testing.assert_close(imag.resolve_neg().cpu(), -x.imag)


def test_a_conjugated_cpu_tensor_is_uploaded_conjugated() -> None:
    x = _complex()
    torch.testing.assert_close(x.conj().to(D0).cpu(), x.conj())
    torch.testing.assert_close(x.conj().imag.to(D0).cpu(), -x.imag)


def test_conjugated_copies_between_remote_devices_and_into_a_conjugated_destination() -> None:
    x = _complex()
    remote = x.to(D0)
    torch.testing.assert_close(remote.conj().to(D1).cpu(), x.conj())
    dst = torch.zeros(3, 4, dtype=torch.complex64, device=D0).conj()  # dst carries the bit, src does not
    dst.copy_(x)
    torch.testing.assert_close(dst.cpu(), x)
    dst.copy_(remote.conj())  # both carry it: a plain copy
    torch.testing.assert_close(dst.cpu(), x.conj())
    cpu_dst = torch.zeros(3, 4, dtype=torch.complex64).conj()
    cpu_dst.copy_(remote)
    torch.testing.assert_close(cpu_dst, x)


def test_ops_whose_inputs_carry_a_math_bit_match_cpu() -> None:
    x = _complex()
    r = torch.randn(4, 5)
    remote = x.to(D0)
    torch.testing.assert_close(torch.linalg.vecdot(remote, remote).cpu(), torch.linalg.vecdot(x, x))
    torch.testing.assert_close(torch.fft.hfft(r.to(D0)).cpu(), torch.fft.hfft(r), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.fft.ihfft(r.to(D0)).cpu(), torch.fft.ihfft(r))
    torch.testing.assert_close((remote.conj() * 2).cpu(), x.conj() * 2)
    torch.testing.assert_close(torch.linalg.pinv(remote).cpu(), torch.linalg.pinv(x), atol=1e-4, rtol=1e-4)


def test_backward_formulas_that_conjugate_match_cpu() -> None:
    torch.manual_seed(0)
    a, b = torch.rand(5) + 0.1, torch.rand(5)
    ra, rb = a.to(D0).requires_grad_(), b.to(D0).requires_grad_()
    ca, cb = a.clone().requires_grad_(), b.clone().requires_grad_()
    grad = torch.randn(5, dtype=torch.complex64)
    torch.autograd.backward(torch.polar(ra, rb), grad.to(D0))
    torch.autograd.backward(torch.polar(ca, cb), grad)
    assert ra.grad is not None and rb.grad is not None
    torch.testing.assert_close(ra.grad.cpu(), ca.grad)
    torch.testing.assert_close(rb.grad.cpu(), cb.grad)


def test_matrix_products_that_read_the_conjugate_bit_themselves_match_cpu() -> None:
    """mm/addmm/bmm/dot skip ATen's Conjugate fallback (CPU/CUDA BLAS reads the bit), so their
    conjugated inputs reach genie's fallback, which materializes them before sending."""
    x = _complex()
    remote = x.to(D0)
    torch.testing.assert_close((remote @ remote.mH).cpu(), x @ x.mH)
    torch.testing.assert_close(torch.mm(remote.mH, remote).cpu(), x.mH @ x)
    torch.testing.assert_close(torch.cov(remote).cpu(), torch.cov(x))
    out = torch.empty(3, 3, dtype=torch.complex64, device=D0)
    torch.mm(remote, remote.mH, out=out)
    torch.testing.assert_close(out.cpu(), x @ x.mH)
    torch.testing.assert_close(torch.vdot(remote[0], remote[1]).cpu(), torch.vdot(x[0], x[1]))
