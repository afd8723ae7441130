"""What one session can learn from or do to another: fresh memory is zeroed, random streams are private."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import wait_until
from tests.raw_client import Gen, RawClient, T, desc, op, resize, seed

PATTERN = 0x5A
SIZES = (4096, 65536)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_fresh_storages_never_hold_a_departed_sessions_bytes(inproc_server):
    """A victim fills storages with a pattern and leaves; every way a new session gets fresh memory is zeroed."""
    server = inproc_server()
    for round_ in range(3):  # the allocator may hand the victim's blocks to any of the fresh storages below
        with RawClient(server.port) as victim:
            victim.handshake()
            pattern = [torch.full((n,), PATTERN, dtype=torch.uint8) for n in SIZES for _ in range(4)]
            victim.send_batch([], uploads=[(i + 1, 0, p) for i, p in enumerate(pattern)])
            victim.sync()
        wait_until(lambda: server.stats()["sessions"] == 0, timeout=5)

        with RawClient(server.port) as c:
            c.handshake()
            got = []
            sid = 100
            for n in SIZES:
                like = torch.empty(n, dtype=torch.uint8)
                strided = torch.empty_strided((n // 8, 2), (4, 1), dtype=torch.uint8)
                c.send_batch([
                    op("aten::empty.memory_format", [[n]], {"dtype": torch.uint8}, [desc(sid + 1, like)]),
                    op("aten::empty_strided", [[n // 8, 2], [4, 1]], {"dtype": torch.uint8},
                       [desc(sid + 2, strided)]),
                    op("aten::new_empty", [T(sid + 1, like), [n]], {}, [desc(sid + 3, like)]),
                    resize(0, sid + 4, n),  # an unseen storage made by RESIZE
                    resize(0, sid + 5, 16), resize(0, sid + 5, n),  # grown by RESIZE
                    op("aten::resize_", [T(sid + 6, torch.empty(4, dtype=torch.uint8)), [n]], {},
                       [desc(sid + 6, like)]),  # grown by the resize_ op
                ], uploads=[(sid + 5, 0, torch.ones(16, dtype=torch.uint8)),
                            (sid + 6, 0, torch.ones(4, dtype=torch.uint8))])
                got += [c.fetch(sid + k, like) for k in (1, 3, 4, 7)]  # 7: never seen, made by the fetch
                got.append(c.fetch(sid + 2, torch.empty(strided.untyped_storage().nbytes(), dtype=torch.uint8)))
                got.append(c.fetch(sid + 5, like)[16:])
                got.append(c.fetch(sid + 6, like)[4:])
                sid += 10
            assert c.sync().deferred == []
        for t in got:
            assert torch.count_nonzero(_bytes(t)) == 0, f"round {round_}: fresh memory holds old bytes"


def _normal(c: RawClient, storage_id: int, n: int = 256, generator: int | None = None, device: int = 0):
    like = torch.empty(n)
    kwargs = {} if generator is None else {"generator": Gen(generator)}
    c.send_batch([op("aten::normal_", [T(storage_id, like), 0.0, 1.0], kwargs, [desc(storage_id, like)],
                     device=device)])
    return c.fetch(storage_id, like, device=device)


@pytest.fixture
def sessions(genie_serve, raw_clients):
    return lambda: raw_clients(genie_serve.port)


def test_sessions_seeded_alike_draw_alike_and_others_differ(sessions):
    a, b, other = sessions(), sessions(), sessions()
    for c, s in ((a, 1234), (b, 1234), (other, 99)):
        c.send_batch([seed(0, 0, s)])
    xa, xb, xo = _normal(a, 1), _normal(b, 1), _normal(other, 1)
    assert torch.equal(xa, xb)
    assert not torch.equal(xa, xo)


def test_unseeded_sessions_do_not_share_a_stream(sessions):
    assert not torch.equal(_normal(sessions(), 1), _normal(sessions(), 1))


def test_one_sessions_draws_do_not_move_anothers_stream(sessions):
    a, noisy, reference = sessions(), sessions(), sessions()
    for c in (a, noisy, reference):
        c.send_batch([seed(0, 0, 7)])
    first = _normal(a, 1)
    for i in range(5):
        _normal(noisy, 10 + i, n=4096)  # same seed, same device, drawing in between
    second = _normal(a, 2)
    assert torch.equal(torch.cat([first, second]), torch.cat([_normal(reference, 1), _normal(reference, 2)]))


def test_named_generators_and_devices_have_their_own_streams(sessions):
    a, b = sessions(), sessions()
    for c in (a, b):
        c.send_batch([seed(0, 0, 5), seed(0, 3, 11), seed(1, 0, 5)])
    on_g3 = _normal(a, 1, generator=3)
    on_d1 = _normal(a, 2, device=1)
    assert torch.equal(_normal(a, 3), _normal(b, 3))  # a's other draws left device 0's default where it was
    assert torch.equal(on_g3, _normal(b, 4, generator=3))
    assert torch.equal(on_d1, _normal(b, 5, device=1))
    assert not torch.equal(on_g3, on_d1)


def test_explicit_default_generator_tag_equals_none(sessions):
    a, b = sessions(), sessions()
    for c in (a, b):
        c.send_batch([seed(0, 0, 21)])
    assert torch.equal(_normal(a, 1, generator=0), _normal(b, 1))


def test_native_dropout_draws_from_the_sessions_generator(sessions):
    a, b, other = sessions(), sessions(), sessions()
    x = torch.ones(512)
    masks = []
    for c, s in ((a, 3), (b, 3), (other, 4)):
        c.send_batch([seed(0, 0, s),
                      op("aten::native_dropout", [T(1, x), 0.5, True], {},
                         [desc(2, x), desc(3, torch.empty(512, dtype=torch.bool))])], uploads=[(1, 0, x)])
        out, mask = c.fetch(2, x), c.fetch(3, torch.empty(512, dtype=torch.bool))
        assert torch.equal(out, mask.float() * 2.0)
        masks.append(mask)
    assert torch.equal(masks[0], masks[1]) and not torch.equal(masks[0], masks[2])
    assert 150 < int(masks[0].sum()) < 362


def test_empty_out_keeps_the_rest_of_its_storage(sessions):
    """empty.out into a view zeroes nothing of the session's own data around it; growth is zeroed."""
    c = sessions()
    base = torch.arange(8.0)
    c.send_batch([op("aten::empty.out", [[2]], {"out": T(1, base[2:4])}, [desc(1, base[2:4])])],
                 uploads=[(1, 0, base)])
    assert c.fetch(1, base).tolist()[4:] == [4.0, 5.0, 6.0, 7.0]
    assert c.fetch(1, base).tolist()[:2] == [0.0, 1.0]
