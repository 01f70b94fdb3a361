# Fails unless README (a path) shows EXAMPLE (a path) whole, in one ```c block.
file(READ "${README}" readme)
file(READ "${EXAMPLE}" example)
string(FIND "${readme}" "```c\n${example}```\n" at)
if(at EQUAL -1)
  message(FATAL_ERROR "${README} does not show ${EXAMPLE} as it is, in one ```c block: copy the file there")
endif()
