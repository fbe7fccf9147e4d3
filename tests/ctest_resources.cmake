# Read by CTest after the gtest_discover_tests lists (TEST_INCLUDE_FILES, see CMakeLists.txt
# here and in launcher/): scripts/test.sh runs CTest in parallel (-j), and these discovered
# gtest cases must not share the machine.
#
# RUN_SERIAL: cases that measure time (an error within 5 s, a rank stopped within 20 s) or run
# with a collective timeout of a few seconds, which a loaded machine could exceed.
# PROCESSORS 2: cases heavy enough to slow their neighbours (many rank threads, long runs).
# RESOURCE_LOCK gpu: the GPU tier's cases share one device among themselves.
set(_tessera_serial
    "^ErrorsFromLocal[.]" "^Errors[A-Za-z]*[.]" "FuzzLayout[A-Za-z]*[.]"
    "^CustomRule[.]RuleFailingOnOneRankFailsEveryRankPromptly$"
    "^Habits[.]CollectiveOnSomeRanksOnlyNamesTheCall$" "^RandomSync[.]MeshWithoutWorldRankZero$"
    "^LossParallel[.]WrongShardDimRaisesOnEveryRank$" "^Launcher[A-Za-z]*[.]")
set(_tessera_heavy "^TpLlama[.]" "^HabitsTutorial[.]" "^Training[.]" "^FullyShard[A-Za-z]*[.]"
                   "^Checkpoint[.]")
foreach(_tessera_test IN LISTS tessera_tests_TESTS tessera_launcher_tests_TESTS)
  foreach(_tessera_re IN LISTS _tessera_serial)
    if(_tessera_test MATCHES "${_tessera_re}")
      set_tests_properties("${_tessera_test}" PROPERTIES RUN_SERIAL TRUE)
    endif()
  endforeach()
  foreach(_tessera_re IN LISTS _tessera_heavy)
    if(_tessera_test MATCHES "${_tessera_re}")
      set_tests_properties("${_tessera_test}" PROPERTIES PROCESSORS 2)
    endif()
  endforeach()
endforeach()
foreach(_tessera_test IN LISTS tessera_gpu_tests_TESTS)
  set_tests_properties("${_tessera_test}" PROPERTIES RESOURCE_LOCK gpu)
endforeach()
