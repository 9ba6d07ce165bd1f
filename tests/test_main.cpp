// doctest's main, with skips reported to CTest (exit 77: tests/skip.h).
#define DOCTEST_CONFIG_IMPLEMENT
#include "skip.h"

int main(int argc, char** argv) { return baton::test::run_tests(argc, argv); }
