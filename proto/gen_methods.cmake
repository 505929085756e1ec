# Generates stria_methods.h from stria.proto: for every service, an enum of
# its methods' indices in declaration order (the order of protobuf-c's
# ServiceDescriptor.methods, which the RPC frames carry), the count, and each
# method's name for the servers' start-up check against the descriptor.
# Usage: cmake -DPROTO=stria.proto -DOUT=stria_methods.h -P gen_methods.cmake
file(READ ${PROTO} text)
string(REGEX REPLACE "//[^\n]*" "" text "${text}")
# Block comments, and the option blocks of methods (rpc X(A) returns (B) { ... }),
# whose braces would end a service early.
string(REGEX REPLACE "/\\*([^*]|\\*+[^*/])*\\*+/" "" text "${text}")
string(REGEX REPLACE "\\)[ \t\n]*{[^{}]*}" ")" text "${text}")
# Semicolons would split CMake lists; the parse does not need them.
string(REPLACE ";" " " text "${text}")
set(out "/* Generated from stria.proto by gen_methods.cmake: do not edit. */\n")
string(APPEND out "#ifndef STRIA_METHODS_H\n#define STRIA_METHODS_H\n")
string(REGEX MATCHALL "service[ \t\n]+[A-Za-z0-9_]+[ \t\n]*{[^}]*}" services "${text}")
if(NOT services)
  message(FATAL_ERROR "gen_methods: no service in ${PROTO}")
endif()
# CamelCase -> UPPER_SNAKE
function(upper_snake name out_var)
  string(REGEX REPLACE "([a-z0-9])([A-Z])" "\\1_\\2" s "${name}")
  string(TOUPPER "${s}" s)
  set(${out_var} "${s}" PARENT_SCOPE)
endfunction()
foreach(svc IN LISTS services)
  string(REGEX MATCH "service[ \t\n]+([A-Za-z0-9_]+)" _ "${svc}")
  upper_snake(${CMAKE_MATCH_1} sname)
  string(APPEND out "\n/* service ${CMAKE_MATCH_1} */\nenum {\n")
  string(REGEX MATCHALL "rpc[ \t\n]+[A-Za-z0-9_]+" rpcs "${svc}")
  set(i 0)
  set(names "")
  foreach(r IN LISTS rpcs)
    string(REGEX REPLACE "rpc[ \t\n]+" "" m "${r}")
    upper_snake(${m} mname)
    string(APPEND out "    STRIA_RPC_${sname}_${mname} = ${i},\n")
    string(APPEND names "#define STRIA_RPC_${sname}_${mname}_NAME \"${m}\"\n")
    math(EXPR i "${i} + 1")
  endforeach()
  string(APPEND out "    STRIA_RPC_${sname}_N_METHODS = ${i},\n};\n${names}")
endforeach()
string(APPEND out "\n#endif\n")
# Rewrite only on change, so dependants are not rebuilt for nothing.
if(EXISTS ${OUT})
  file(READ ${OUT} old)
endif()
if(NOT "${old}" STREQUAL "${out}")
  file(WRITE ${OUT} "${out}")
endif()
