# What a LibTorch install may lack for c10d's headers, found once for every target:
#
#  - Gloo's headers (ProcessGroupGloo.hpp includes <gloo/...>). Debian's libtorch-dev depends
#    on libgloo-dev; the pip wheel and the pytorch.org archive ship none. Searched in
#    TESSERA_GLOO_INCLUDE_DIR, the LibTorch tree, then the system; configuring stops with what
#    to install when none is found.
#  - NCCL's header (ProcessGroupNCCL.hpp includes <nccl.h>) where LibTorch has CUDA: the pip
#    wheel keeps it in site-packages/nvidia/nccl/include, which TorchConfig does not add.
#
# The result is the INTERFACE target tessera_torch_extras, which the library links publicly,
# so programs and find_package(Tessera) users get the same include directories.
#
# fmt: LibTorch 2.x puts its own fmt headers (another major version) in its include directory,
# ahead of the system's; a compiled fmt library would then not match the headers. Tessera uses
# fmt header-only (fmt::fmt-header-only), so whichever headers win, nothing links against it.

set(TESSERA_GLOO_INCLUDE_DIR "" CACHE PATH "Directory holding gloo/algorithm.h (default: search)")

# The LibTorch root: Torch_DIR is <root>/share/cmake/Torch.
get_filename_component(_tessera_torch_root "${Torch_DIR}/../../.." ABSOLUTE)
# A pip install's site-packages (<site-packages>/torch/share/cmake/Torch).
get_filename_component(_tessera_site_packages "${_tessera_torch_root}/.." ABSOLUTE)

if(NOT TESSERA_GLOO_INCLUDE_DIR)
  unset(_tessera_gloo CACHE)
  find_path(_tessera_gloo gloo/algorithm.h
    HINTS "${_tessera_torch_root}/include" ${TORCH_INCLUDE_DIRS}
    PATHS /usr/include /usr/local/include)
  if(_tessera_gloo)
    set(TESSERA_GLOO_INCLUDE_DIR "${_tessera_gloo}" CACHE PATH
        "Directory holding gloo/algorithm.h (default: search)" FORCE)
  endif()
endif()
if(NOT EXISTS "${TESSERA_GLOO_INCLUDE_DIR}/gloo/algorithm.h")
  message(FATAL_ERROR
    "Tessera needs Gloo's headers (c10d's ProcessGroupGloo.hpp includes <gloo/algorithm.h>), "
    "and this LibTorch (${_tessera_torch_root}) ships none. Install them: on Debian or Ubuntu "
    "`apt-get install libgloo-dev`; elsewhere point -DTESSERA_GLOO_INCLUDE_DIR=<dir> at a "
    "directory holding gloo/algorithm.h and gloo/config.h (for example a Debian libgloo-dev "
    "package unpacked with `dpkg -x`; scripts/gpu-deps.sh does that).")
endif()

add_library(tessera_torch_extras INTERFACE)
# For an installed Tessera the directory is kept as found, unless it lies inside this
# source or build tree (such a directory does not outlive the build).
function(tessera_extra_include dir)
  set(where "$<BUILD_INTERFACE:${dir}>")
  string(FIND "${dir}/" "${CMAKE_SOURCE_DIR}/" in_source)
  string(FIND "${dir}/" "${CMAKE_BINARY_DIR}/" in_build)
  if(NOT in_source EQUAL 0 AND NOT in_build EQUAL 0)
    list(APPEND where "$<INSTALL_INTERFACE:${dir}>")
  endif()
  # After LibTorch's own include directories: only what they lack is taken from here.
  target_include_directories(tessera_torch_extras SYSTEM INTERFACE ${where})
endfunction()
tessera_extra_include("${TESSERA_GLOO_INCLUDE_DIR}")

# NCCL is compiled in only where LibTorch itself was built with CUDA.
if(TORCH_CUDA_LIBRARIES OR TARGET torch_cuda)
  set(TESSERA_WITH_NCCL ON)
  find_path(TESSERA_NCCL_INCLUDE_DIR nccl.h
    HINTS "${_tessera_site_packages}/nvidia/nccl/include" $ENV{NCCL_HOME}/include
          $ENV{NCCL_ROOT}/include ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include
    PATHS /usr/include)
  if(NOT TESSERA_NCCL_INCLUDE_DIR)
    message(FATAL_ERROR
      "This LibTorch has CUDA, and c10d's NCCL header needs <nccl.h>, which was not found "
      "(looked in ${_tessera_site_packages}/nvidia/nccl/include, $NCCL_HOME, the CUDA "
      "toolkit). `pip install nvidia-nccl-cu13` (or -cu12, matching torch) or set "
      "-DTESSERA_NCCL_INCLUDE_DIR=<dir with nccl.h>.")
  endif()
  tessera_extra_include("${TESSERA_NCCL_INCLUDE_DIR}")
  message(STATUS "Tessera: NCCL header in ${TESSERA_NCCL_INCLUDE_DIR}")
else()
  set(TESSERA_WITH_NCCL OFF)
endif()
