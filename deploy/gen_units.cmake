# Writes the systemd units from their templates with the paths of an
# installation: run at configure time for the build's own prefix (the tests
# read those copies) and again at install time, for the prefix actually
# installed to (`cmake --install --prefix`, or the package's /usr), so the
# installed units always name the installed programs.
# Inputs: STRIA_UNIT_SRC (templates), STRIA_UNIT_OUT (folder), STRIA_PREFIX,
# STRIA_BINDIR_REL, STRIA_DOCDIR_REL (relative to the prefix, or absolute),
# STRIA_CONFDIR (absolute).
foreach(v STRIA_UNIT_SRC STRIA_UNIT_OUT STRIA_PREFIX STRIA_BINDIR_REL STRIA_DOCDIR_REL STRIA_CONFDIR)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "gen_units.cmake: ${v} is not set")
  endif()
endforeach()
foreach(pair "STRIA_BINDIR;${STRIA_BINDIR_REL}" "STRIA_DOCDIR;${STRIA_DOCDIR_REL}")
  list(GET pair 0 var)
  list(GET pair 1 dir)
  if(IS_ABSOLUTE "${dir}")
    set(${var} "${dir}")
  else()
    set(${var} "${STRIA_PREFIX}/${dir}")
  endif()
endforeach()
foreach(unit stria-coordinator.service stria-worker@.service stria.target)
  configure_file(${STRIA_UNIT_SRC}/${unit}.in ${STRIA_UNIT_OUT}/${unit} @ONLY)
endforeach()
