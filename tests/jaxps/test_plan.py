"""The wire plan: chunking of large tensors, fusion of small ones."""

from jaxps._src.plan import make_plan


def plan(sizes, dtypes=None, part=100, servers=2):
    names = [f"t{i}" for i in range(len(sizes))]
    dtypes = dtypes or ["<f4"] * len(sizes)
    itemsizes = [int(d[-1]) for d in dtypes]
    return make_plan(
        names,
        sizes,
        dtypes,
        itemsizes,
        [-i for i in range(len(sizes))],
        partition_bytes=part,
        weights=[1.0] * servers,
    )


def covered(pieces, sizes):
    seen = {t: [] for t in range(len(sizes))}
    for p in pieces:
        for t, lo, hi in p.members:
            seen[t].append((lo, hi))
    for t, ranges in seen.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == sizes[t]
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_small_tensors_are_fused_within_the_partition():
    sizes = [5, 5, 5, 5, 5, 5]  # 20 bytes each, 100-byte pieces
    pieces = plan(sizes)
    assert [len(p.members) for p in pieces] == [5, 1]
    assert all(p.length * 4 <= 100 for p in pieces)
    assert pieces[0].fused and pieces[0].wire_name.startswith("fused:")
    assert pieces[1].wire_name == "t5"  # a lone tensor keeps its own name
    covered(pieces, sizes)


def test_large_tensors_are_chunked_and_dtypes_never_mixed():
    sizes = [60, 3, 3, 2]
    dtypes = ["<f4", "<f4", "<f8", "<f8"]
    pieces = plan(sizes, dtypes)
    big = [p for p in pieces if p.wire_name == "t0"]
    # 240 bytes need 3 pieces of 100; 4 share the 2 servers evenly
    assert len(big) == 4 and {p.key & 0xFFFF for p in big} == {0, 1, 2, 3}
    assert all(p.length == 15 for p in big)
    for p in pieces:
        assert len({dtypes[t] for t, _, _ in p.members}) == 1
    covered(pieces, sizes)


def test_plan_is_deterministic_and_spreads_over_servers():
    sizes = [100] * 8
    a, b = plan(sizes, part=400), plan(sizes, part=400)
    assert a == b
    assert {p.server for p in a} == {0, 1}
    assert len({p.key for p in a}) == len(a)


def test_mixed_mode_sends_the_formula_share_to_cpu_servers():
    from jaxps._src import topology

    n, k = 4, 2
    weights = topology.mixed_mode_weights(n, k)
    names = [f"t{i}" for i in range(200)]
    pieces = make_plan(
        names,
        [1000] * 200,
        ["<f4"] * 200,
        [4] * 200,
        [0] * 200,
        partition_bytes=4000,
        weights=weights,
    )
    cpu = sum(p.length for p in pieces if p.server < k)
    total = sum(p.length for p in pieces)
    assert abs(cpu / total - topology.cpu_server_share(n, k)) < 0.01


def test_buffers_gather_fused_pieces_and_outputs_view_their_dest():
    import numpy as np

    from jaxps._src.plan import Gather, buffers, payload

    sizes, dtypes = [5, 60, 3], ["<f4", "<f4", "<f4"]
    pieces = plan(sizes, dtypes)
    flats = [
        np.arange(s, dtype=np.float32) + 100 * t for t, s in enumerate(sizes)
    ]
    laid_out, outs = buffers(pieces, flats)
    assert len(laid_out) == len(pieces)
    for piece, (source, dest) in zip(pieces, laid_out):
        expected = np.concatenate(
            [flats[m.tensor][m.start : m.stop] for m in piece.members]
        )
        np.testing.assert_array_equal(payload(source), expected)
        assert dest.size == source.size == piece.length
        assert source.nbytes == expected.nbytes and source.dtype == np.float32
        dest[...] = -payload(source)  # as a transport writes a sum
    for t, out in enumerate(outs):
        np.testing.assert_array_equal(out, -flats[t])
    fused = next(p for p in pieces if p.fused)
    assert [m.tensor for m in fused.members] == [0, 2]
    # a fused payload is not copied: its parts are the members' arrays
    gather = laid_out[pieces.index(fused)].source
    assert isinstance(gather, Gather)
    assert np.shares_memory(gather.parts[0], flats[0])
    assert np.shares_memory(gather.parts[1], flats[2])
    into = np.empty(gather.size, gather.dtype)
    gather.copy_into(into)
    np.testing.assert_array_equal(into, [0, 1, 2, 3, 4, 200, 201, 202])
    assert payload(gather) is payload(gather)  # joined once


def test_a_gathers_fingerprint_is_its_joined_payloads():
    import numpy as np

    from jaxps._src.plan import Gather
    from jaxps._src.transport.base import fingerprint

    rng = np.random.default_rng(0)
    # small (all of it), ends within one part, ends across many parts
    for sizes in (
        [3, 5],
        [5000, 7, 3000],
        [100] * 80,
        [1, 2047, 1, 4000],
        [2000, 0, 1, 3000, 0],
    ):
        parts = [rng.standard_normal(n).astype(np.float32) for n in sizes]
        gather = Gather(parts)
        assert fingerprint(gather) == fingerprint(np.concatenate(parts)), sizes


def test_a_call_of_one_piece_goes_to_its_check_server():
    # so the piece carries the call check, instead of a check of its own
    from jaxps._src.plan import call_check

    for servers in (2, 3, 5):
        for i in range(40):
            names = [
                f"grads{i}['w']:float32[3]@0",
                f"grads{i}['b']:float32[2]@0",
            ]
            check = call_check(names, [(3,), (2,)], ["float32"] * 2)
            pieces = make_plan(
                names,
                [3, 2],
                ["<f4"] * 2,
                [4, 4],
                [0, -1],
                partition_bytes=1 << 20,
                weights=[1.0] * servers,
                salt=check.salt,
            )
            assert len(pieces) == 1
            assert pieces[0].server == check.server(servers)
