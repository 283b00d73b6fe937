"""Whether a kernel launched as a programmatic dependent (PDL) reaches a global access before its
``griddepcontrol.wait``, read from its PTX's control flow; no GPU. Such an access would be a silent race:
it may read what the kernel before it in the stream has not written yet. Used by
``hopper_sm90_compile.py`` (through ``ddtree_sm90_compile.compile_sm90``), which fails such a kernel.
"""

from __future__ import annotations

import re

# a PTX instruction that reads or writes global memory: a .global state space in its name (ld, st, atom,
# red, cp.async's source, the bulk copies and L2 prefetches) or a tensor-map copy (TMA)
GLOBAL_ACCESS = re.compile(r"^(?:@!?%?\w+\s+)?(?:[\w:]+\.)*(?:global|tensor)\b")
LABEL = re.compile(r"^(\$?[\w.$]+):$")  # a whole line (comments cut)
BRANCH = re.compile(r"^(@!?%?\w+\s+)?bra(?:\.uni)?\s+(\$?[\w.$]+);")


def accesses_before_grid_wait(ptx: str) -> tuple[int, list[str]]:
    """Where a kernel is launched as a programmatic dependent, every global access must come after its
    thread's ``griddepcontrol.wait`` (else it may read what the kernel before it has not written yet).
    Checked on the PTX's control flow: a must-analysis over its blocks between labels (the labels and
    branches of the function's body, at brace depth 1; the branches of inline-asm blocks, such as
    mbarrier wait loops, stay inside their block), a branch passing on the state at its own line.
    Returns the number of global accesses and those that some path reaches without a wait (as
    ``line N: instruction``)."""
    blocks, labels, depth = [[]], {}, 0  # blocks: (kind, text, line) items; kind wait/access/branch/jump
    for number, raw in enumerate(ptx.splitlines(), 1):
        line = raw.split("//")[0].strip()
        if not line:
            continue
        if depth == 1 and (label := LABEL.match(line)):
            labels[label.group(1)] = len(blocks)
            blocks.append([])
            continue
        depth += line.count("{") - line.count("}")
        if depth == 1 and (m := BRANCH.match(line)):
            blocks[-1].append(("branch" if m.group(1) else "jump", m.group(2), number))
        elif line.startswith(("ret;", "exit;")):
            blocks[-1].append(("jump", "", number))
        elif "griddepcontrol.wait" in line:
            blocks[-1].append(("wait", "", number))
        elif any(GLOBAL_ACCESS.match(statement.strip(" \t{}")) for statement in line.split(";")):
            # a line may hold a whole inline-asm block: "{ .reg .pred p; ...; @p discard.global.L2 [%rd1], 128; }"
            blocks[-1].append(("access", line, number))

    def states(i, waited):
        """Block i's items, each with whether a wait came before it, up to its first jump."""
        for item in blocks[i]:
            waited = waited or item[0] == "wait"
            yield item, waited
            if item[0] == "jump":
                return

    falls_through = [all(kind != "jump" for kind, _, _ in block) for block in blocks]
    waited_in = [i > 0 for i in range(len(blocks))]  # "waited" until a path without shows up; not the entry
    changed = True
    while changed:
        incoming = [[] for _ in blocks]
        for i in range(len(blocks)):
            waited = waited_in[i]  # then the state at each item: at the block's end where it falls through
            for (kind, target, _), waited in states(i, waited_in[i]):
                if kind in ("branch", "jump") and target in labels:
                    incoming[labels[target]].append(waited)
            if falls_through[i] and i + 1 < len(blocks):
                incoming[i + 1].append(waited)
        new = [False] + [all(values) for values in incoming[1:]]
        changed, waited_in = new != waited_in, new
    accesses = [(item, waited) for i in range(len(blocks)) for item, waited in states(i, waited_in[i])
                if item[0] == "access"]
    return len(accesses), [f"line {number}: {text}" for (_, text, number), waited in accesses if not waited]
