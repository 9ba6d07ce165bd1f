# baton-launch's tests, in a program of their own: they fork and exec the launcher, and wait for
# signals and children, which is best done without the runtime's threads in the same process.
# baton-launch-rank is a rank that joins the control plane, for the tests that need one.
add_executable(baton-launch-rank launch_rank.cpp)
target_link_libraries(baton-launch-rank PRIVATE baton::transport baton::warnings fmt::fmt)

add_executable(baton-launch-tests test_main.cpp test_launch.cpp)
target_link_libraries(baton-launch-tests PRIVATE baton::launch baton::warnings doctest::doctest fmt::fmt)
target_compile_definitions(baton-launch-tests PRIVATE BATON_BIN_DIR="${CMAKE_RUNTIME_OUTPUT_DIRECTORY}")
add_dependencies(baton-launch-tests baton-launch baton-launch-rank)
doctest_discover_tests(baton-launch-tests PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77)
