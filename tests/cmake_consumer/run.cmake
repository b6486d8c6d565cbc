# Test cmake_consumer (CMakeLists.txt): installs the core of the build BUILD_DIR into WORK_DIR/prefix
# (emptied first), then configures, builds and runs this folder's project against that prefix with
# the build's generator, compiler, build type and sanitizers (LINKER_FLAGS), and with
# gradsparse::core_cuda where the core was built with CUDA (CUDA_ROOT: the toolkit the build found),
# the program run by the build's CMAKE_CROSSCOMPILING_EMULATOR where it has one (EMULATOR).
# Fails on the first step that fails.
#   cmake -DBUILD_DIR=... -DWORK_DIR=... -DGENERATOR=... -DMAKE_PROGRAM=... -DCXX=... -DBUILD_TYPE=...
#         [-DLINKER_FLAGS=...] [-DCUDA_ROOT=...] [-DEMULATOR=...] -P run.cmake
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE status)
  if(NOT status EQUAL 0)
    string(REPLACE ";" " " command "${ARGN}")
    message(FATAL_ERROR "cmake_consumer: `${command}` failed (${status})")
  endif()
endfunction()

set(cuda_options "")
if(CUDA_ROOT)
  set(cuda_options -DGRADSPARSE_CUDA=ON -DCUDAToolkit_ROOT=${CUDA_ROOT})
endif()
file(REMOVE_RECURSE ${WORK_DIR})
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --config ${BUILD_TYPE} --prefix ${WORK_DIR}/prefix)
# Every header that an installed header includes is installed too (the core's internal ones are not).
set(include_dir ${WORK_DIR}/prefix/include/gradsparse)
file(GLOB installed ${include_dir}/*.h)
foreach(header ${installed})
  file(STRINGS ${header} includes REGEX "^#include \"gradsparse/")
  foreach(line ${includes})
    string(REGEX REPLACE "^#include \"gradsparse/([^\"]+)\".*" "\\1" included "${line}")
    if(NOT EXISTS ${include_dir}/${included})
      message(FATAL_ERROR "cmake_consumer: the installed ${header} includes gradsparse/${included}, which is not installed")
    endif()
  endforeach()
endforeach()
run(${CMAKE_COMMAND} -S ${CMAKE_CURRENT_LIST_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM} -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_BUILD_TYPE=${BUILD_TYPE}
    -DCMAKE_EXE_LINKER_FLAGS=${LINKER_FLAGS} -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix ${cuda_options})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build --config ${BUILD_TYPE})
run(${EMULATOR} ${WORK_DIR}/build/consumer)
