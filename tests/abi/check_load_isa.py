"""What runs while libkt loads runs on every CPU: the static initialisers
(_GLOBAL__sub_I_*) and the library functions they call use no instruction
of AVX, AVX2, AVX-512 or AMX. kt's ISA files are compiled with those
extensions; a constructor of theirs (a table copied at load, say) would
fault on a CPU without them before dispatch could choose another table."""
import re
import subprocess
import sys

lib = sys.argv[1]
text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", lib], check=True, capture_output=True, text=True).stdout

# function name -> its instruction lines
functions, name = {}, None
for line in text.splitlines():
    m = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
    if m:
        name = m.group(1)
        functions[name] = []
    elif name and line.strip():
        functions[name].append(line.strip())
    else:
        name = None

# Registers and mnemonics of the extensions (VEX/EVEX-encoded scalar and
# xmm forms included: any v-prefixed mnemonic is AVX or later).
beyond_baseline = re.compile(r"%[xyz]mm(1[6-9]|2[0-9]|3[01])\b|%ymm|%zmm|%k[0-7]\b|\btile|\bldtilecfg|\bv[a-z0-9]+\s")
inits = [f for f in functions if f.startswith("_GLOBAL__sub_I_")]
if not inits:
    print(f"{lib}: no static initialisers found (objdump output not understood?)")
    sys.exit(1)
problems = []
for init in inits:
    # The initialiser and the library functions it calls directly.
    reached = [init]
    for insn in functions[init]:
        m = re.search(r"\bcall\s+[0-9a-f]+ <([^>@+]+)>", insn)
        if m and m.group(1) in functions and m.group(1) not in reached:
            reached.append(m.group(1))
    for f in reached:
        for insn in functions[f]:
            if beyond_baseline.search(insn.split(":", 1)[-1]):
                problems.append(f"{init} -> {f}: {insn}")
if problems:
    print("instructions beyond x86-64's baseline run while libkt loads:")
    print("\n".join(problems[:40]))
    sys.exit(1)
print(f"{len(inits)} static initialisers (and what they call): baseline x86-64 instructions only")
