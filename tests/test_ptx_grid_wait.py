"""scripts/ptx_grid_wait.py, which fails a PDL kernel whose PTX reaches a global access before its
``griddepcontrol.wait`` (scripts/hopper_sm90_compile.py), on small PTX bodies written as Triton's
LLVM backend prints them: labels and branches in the function's braces, inline-asm blocks in their
own braces with local wait loops, predicated instructions, blocks that continue without a label."""

import pytest
from conftest import load_script

ptx_grid_wait = load_script("ptx_grid_wait")


def _kernel(*body: str) -> str:
    return "\n".join([".visible .entry k(", "\t.param .u64 k_param_0", ")", ".reqntid 384", "{",
                      "\t.reg .b32 \t%r<9>;", *body, "}"])


WAIT = "\tgriddepcontrol.wait; mov.u32 %r8, 0;"
MBARRIER_WAIT = ["\t{", "\t.reg .pred complete;", "\twaitLoop:",
                 "\tmbarrier.try_wait.parity.shared::cta.b64 complete, [%r1], %r2;",
                 "\t@!complete bra.uni waitLoop;", "\t}"]


@pytest.mark.parametrize("name, body, early", [
    ("wait first", [WAIT, "\tld.global.b32 { %r1 }, [ %rd1 + 0 ];", "\tret;"], []),
    ("load first", ["\tld.global.b32 { %r1 }, [ %rd1 + 0 ];", WAIT, "\tret;"], [7]),
    # a conditional branch ends a block that LLVM continues without a label: its target is reached
    # with the state at the branch, not at the end of the lines after it
    ("branch around the wait", ["\t@%p1 bra \t$L__BB0_2;", "// %bb.1:", WAIT, "\tld.global.b32 %r2, [%rd2];",
                                "$L__BB0_2:", "\tst.global.b32 [%rd3], %r2;", "\tret;"], [12]),
    ("wait on both paths", ["\t@%p1 bra \t$L__BB0_2;", WAIT, "\tbra.uni \t$L__BB0_3;", "$L__BB0_2:", WAIT,
                            "$L__BB0_3:", "\tst.global.b32 [%rd3], %r2;", "\tret;"], []),
    # warp-specialised partitions: a dispatch by warp, each partition its own wait, a worker loop
    ("each partition waits", ["\tsetp.lt.u32 \t%p2, %r2, 4;", "\t@%p2 bra \t$L__BB0_4;", "\tbra.uni \t$L__BB0_1;",
                              "$L__BB0_4:", WAIT, "\tld.global.b32 %r3, [%rd1];", "\tret;",
                              "$L__BB0_1:", *MBARRIER_WAIT, WAIT, "\tcp.async.cg.shared.global [ %r4 + 0 ], [ %rd5 + 0 ], 0x10, %r5;",
                              "\t@%p3 bra \t$L__BB0_1;", "\tret;"], []),
    ("a worker without its wait", ["\t@%p2 bra \t$L__BB0_4;", "\tbra.uni \t$L__BB0_1;", "$L__BB0_4:", WAIT,
                                   "\tld.global.b32 %r3, [%rd1];", "\tret;", "$L__BB0_1:", *MBARRIER_WAIT,
                                   "\tcp.async.cg.shared.global [ %r4 + 0 ], [ %rd5 + 0 ], 0x10, %r5;",
                                   "\t@%p3 bra \t$L__BB0_1;", "\tret;"], [20]),
    # a loop whose back edge comes from before the wait: the load in its header runs once unwaited
    ("loop entered before the wait", ["$L__BB0_1:", "\tld.global.nc.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];", WAIT,
                                      "\t@%p1 bra \t$L__BB0_1;", "\tret;"], [8]),
    ("a predicated L2 prefetch in inline asm", ["\t{", "\t.reg .pred p;", "\tsetp.ne.b32 p, %r1, 0;",
                                                "\t@p cp.async.bulk.prefetch.L2.global [%rd1], %r2;", "\t}", WAIT,
                                                "\tret;"], [10]),
    ("a TMA copy", ["\tcp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], "
                    "[%rd2, {%r3, %r4}], [%r5];", WAIT, "\tret;"], [7]),
])
def test_global_accesses_before_the_grid_wait(name, body, early):
    total, found = ptx_grid_wait.accesses_before_grid_wait(_kernel(*body))
    assert [int(line.split(":")[0].split()[1]) for line in found] == early, name
    assert total == sum(1 for line in body if ptx_grid_wait.GLOBAL_ACCESS.match(line.strip())), name


def test_an_inline_asm_block_on_one_line_is_read_statement_by_statement():
    block = "\t{ .reg .pred p; setp.ne.b32 p, %r1, 0; @p discard.global.L2 [%rd1], 128; mov.b32 %r2, 0; }"
    assert ptx_grid_wait.accesses_before_grid_wait(_kernel(block, WAIT, "\tret;")) == (1, [f"line 7: {block.strip()}"])
    assert ptx_grid_wait.accesses_before_grid_wait(_kernel(WAIT, block, "\tret;")) == (1, [])


def test_shared_param_and_barrier_instructions_are_not_global_accesses():
    for line in ("ld.shared.b8 %rs1, [%r479+231204];", "ld.param.b32 %r1, [k_param_0];",
                 "mbarrier.arrive.shared::cta.b64 _, [%r1];", "st.shared.v4.b32 [%r2], {%r3, %r4, %r5, %r6};",
                 "@%p1 bra $L__BB0_2;", "fence.proxy.async.shared::cta;"):
        assert not ptx_grid_wait.GLOBAL_ACCESS.match(line), line


def test_an_instruction_with_a_state_space_qualifier_is_not_a_label():
    assert not ptx_grid_wait.LABEL.match("st.shared::cta.b32 [%r1], %r2;")
    assert ptx_grid_wait.LABEL.match("$L__BB0_42:").group(1) == "$L__BB0_42"
