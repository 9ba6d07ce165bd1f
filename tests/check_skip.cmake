# Runs baton-skip-selftest (tests/skip_selftest.cpp) case by case, with and without CI=true, and
# checks each exit status: a skip is 77 (CTest's SKIP_RETURN_CODE), never 0; a skip never hides
# a failed check; under CI=true only a GPU skip stays a skip. Usage: cmake -DPROG=... -P this.
function(expect status ci cases)
  if(ci)
    set(env_args -E env CI=true)
  else()
    set(env_args -E env --unset=CI)
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} ${env_args} ${PROG} --test-case=${cases}
                  RESULT_VARIABLE got OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT got EQUAL status)
    message(FATAL_ERROR "${cases} (CI=${ci}): exit status ${got}, expected ${status}\n${out}")
  endif()
  message(STATUS "${cases} (CI=${ci}): ${got}, as expected")
endfunction()

expect(77 OFF "Skip.ForWantOfAGpu")
expect(77 ON "Skip.ForWantOfAGpu")           # CI has no GPU: a skip there too
expect(77 OFF "Skip.ForWantOfMpirun")
expect(1 ON "Skip.ForWantOfMpirun")          # CI must have mpirun: a failure
expect(1 OFF "Skip.AfterAFailedCheck")       # the failure shows
expect(0 OFF "Skip.ForWantOfAGpu,Skip.Runs")  # something ran and passed
