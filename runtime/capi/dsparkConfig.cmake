# find_package(dspark) from dspark's own package folder:
#
#   cmake -Ddspark_DIR="$(python -m dspark.tools.capi --cmake-dir)" ...
#   find_package(dspark REQUIRED)   target_link_libraries(app PRIVATE dspark::dspark)
#
# builds libdspark from the sources beside this file into the calling project's build tree, against the python
# given as DSPARK_PYTHON_EXECUTABLE (else $DSPARK_PYTHON, else python3 on PATH), checked to import this very
# dspark. An installed tree (`python -m dspark.tools.capi --build DIR`) has its own dsparkConfig.cmake.
if(TARGET dspark::dspark)
  return()
endif()
if(NOT DSPARK_PYTHON_EXECUTABLE)
  if(DEFINED ENV{DSPARK_PYTHON})
    set(DSPARK_PYTHON_EXECUTABLE "$ENV{DSPARK_PYTHON}")
  else()
    find_program(DSPARK_PYTHON_EXECUTABLE NAMES python3 python)
  endif()
endif()
execute_process(COMMAND "${DSPARK_PYTHON_EXECUTABLE}" -c "import dspark.runtime.capi as c; print(c.CAPI_DIR)"
                OUTPUT_VARIABLE _dspark_dir OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _dspark_rc ERROR_QUIET)
get_filename_component(_dspark_here "${CMAKE_CURRENT_LIST_DIR}" REALPATH)
if(NOT _dspark_rc EQUAL 0 OR NOT _dspark_dir STREQUAL _dspark_here)
  set(dspark_FOUND FALSE)
  set(dspark_NOT_FOUND_MESSAGE "the python '${DSPARK_PYTHON_EXECUTABLE}' does not import the dspark at "
      "${_dspark_here}; pass -DDSPARK_PYTHON_EXECUTABLE=<the python that has this dspark installed>")
  return()
endif()
set(DSPARK_BUILD_EXAMPLES OFF)
add_subdirectory("${_dspark_here}" "${CMAKE_BINARY_DIR}/_dspark_capi")
set(dspark_FOUND TRUE)
