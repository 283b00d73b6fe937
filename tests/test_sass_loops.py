"""scripts/sass_loops.py, which the perf log's static tables come from (the step loops' instructions,
fixed-stall cycles and opcodes), on a small SASS listing written as cuobjdump prints one."""

from conftest import load_script

sass_loops = load_script("sass_loops")


def _listing(code: list[tuple[int, str, int]]) -> str:
    """``cuobjdump -sass`` text of ``(address, instruction, fixed stall)``: the stall in bits 41-44 of the
    encoding's second word, the other bits set, so that only those four may be read."""
    lines = ["        Function : kernel", "        .headerflags    @\"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)\""]
    for address, text, stall in code:
        high = 0x7F << 45 | stall << 41 | 0x1 << 40 | 0x3800000
        lines.append(f"        /*{address:04x}*/                   {text} ;{' ' * 20}/* 0x0000000000f00947 */")
        lines.append(f"{' ' * 70}/* 0x{high:016x} */")
    return "\n".join(lines) + "\n"


# a step loop (0x10-0x70) holding an elected thread's TMA issue loop (0x40-0x50); a cold block after
# the code's end (0xb0-0xd0, an mbarrier wait's retry) branching back into the step
STEP = [
    (0x00, "MOV R1, c[0x0][0x28]", 1),
    (0x10, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24", 1),
    (0x20, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8], R3", 2),
    (0x30, "@!P1 BRA 0xb0", 3),
    (0x40, "UTMALDG.2D [UR16], [UR6]", 4),
    (0x50, "@P0 BRA.U.ANY 0x40", 5),
    (0x60, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR12], R24, gsb0", 6),
    (0x70, "@P2 BRA P3, 0x10", 7),
    (0x80, "EXIT", 1),
    (0x90, "BRA 0x90", 1),
    (0xa0, "NOP", 0),
    (0xb0, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8], R3", 1),
    (0xc0, "@!P1 BRA 0xb0", 1),
    (0xd0, "BRA 0x20", 1),
]


def test_fixed_stall_is_the_control_bits_stall_count():
    assert sass_loops.fixed_stall(0x000FE20003800000) == 1  # a listing's: 0x7F1 above bit 40
    for stall in range(16):
        assert sass_loops.fixed_stall(stall << 41 | 0xFFFF << 45 | 0x1FF << 32) == stall


def test_the_step_loop_is_found_with_its_inner_issue_loop_and_without_the_cold_retry():
    lines = sass_loops.wgmma_loops(_listing(STEP))
    assert len(lines) == 2, lines
    assert lines[0].startswith("loop 0x10-0x70: 7 instructions, 28 fixed-stall cycles (HGMMA 2, MUFU 0, FMUL 0,")
    assert "SYNCS 1, UTMALDG 1)" in lines[0]
    assert lines[1] == "  order: HGMMA SYNCS HGMMA"


def test_a_loop_without_wgmmas_is_not_a_step():
    no_wgmma = [(a, "FMUL R1, R1, R2" if text.startswith("HGMMA") else text, s) for a, text, s in STEP]
    assert sass_loops.wgmma_loops(_listing(no_wgmma)) == []
