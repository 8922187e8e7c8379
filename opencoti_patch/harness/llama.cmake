# The libraries of one llama.cpp build, for a program of the harness (this folder's, and the lab's in
# opencoti_patch/lab/harness/, which includes this file):
#
#   -DLLAMA_SRC=<llama.cpp source> -DLLAMA_BIN=<llama build>/bin
#
# Links the build's shared libllama, and libllama-common when the build has it (OPENCOTI_WITH_COMMON: then
# common's argument parser takes every flag the tree knows, e.g. --sparse-attn on a patched tree; without it a
# program uses a small parser of its own, so a build of just ggml + libllama is enough). The backends
# (libggml-cpu*.so, libggml-cuda.so) are loaded from LLAMA_BIN at run time (GGML_BACKEND_DL builds).
set(OPENCOTI_HARNESS_DIR ${CMAKE_CURRENT_LIST_DIR})  # opencoti-harness.h: what the programs share
set(CMAKE_CXX_STANDARD 17)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
if (NOT CMAKE_BUILD_TYPE)
    set(CMAKE_BUILD_TYPE Release)
endif()

set(LLAMA_SRC "" CACHE PATH "llama.cpp source tree (headers)")
set(LLAMA_BIN "" CACHE PATH "bin/ folder of a llama.cpp build (shared libs + backends)")
if (NOT LLAMA_SRC OR NOT LLAMA_BIN)
    message(FATAL_ERROR "set -DLLAMA_SRC=<llama.cpp source> and -DLLAMA_BIN=<llama build>/bin")
endif()

find_package(Threads REQUIRED)

option(OPENCOTI_WITH_COMMON "link libllama-common (full llama.cpp argument parser)" ON)
find_library(_lib_llama_common NAMES llama-common PATHS ${LLAMA_BIN} NO_DEFAULT_PATH)
set(OPENCOTI_LLAMA_LIBS)
if (OPENCOTI_WITH_COMMON AND _lib_llama_common)
    list(APPEND OPENCOTI_LLAMA_LIBS ${_lib_llama_common})
    set(OPENCOTI_HAVE_COMMON ON)
else()
    set(OPENCOTI_HAVE_COMMON OFF)
endif()
message(STATUS "opencoti-harness: with libllama-common: ${OPENCOTI_HAVE_COMMON}")
foreach(_name llama ggml ggml-base)
    find_library(_lib_${_name} NAMES ${_name} PATHS ${LLAMA_BIN} NO_DEFAULT_PATH REQUIRED)
    list(APPEND OPENCOTI_LLAMA_LIBS ${_lib_${_name}})
endforeach()

# opencoti_program(NAME SOURCE): an executable against the build, its backends loaded from LLAMA_BIN
function(opencoti_program name source)
    add_executable(${name} ${source})
    target_include_directories(${name} PRIVATE
        ${OPENCOTI_HARNESS_DIR} ${LLAMA_SRC}/include ${LLAMA_SRC}/ggml/include ${LLAMA_SRC}/common ${LLAMA_SRC}/vendor)
    target_compile_definitions(${name} PRIVATE OPENCOTI_BACKEND_DIR="${LLAMA_BIN}")
    target_link_libraries(${name} PRIVATE ${OPENCOTI_LLAMA_LIBS} Threads::Threads)
    set_target_properties(${name} PROPERTIES BUILD_RPATH "${LLAMA_BIN}")
endfunction()
