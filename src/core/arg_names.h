// Names of the kt_arg_id values as messages print them ("KT_ARG_X"). In core,
// below every layer whose messages name an argument: the layer's calls and
// the checkpoint writers.
#pragma once

#include <string>

#include "kt_c_api.h"

namespace kt {

const char* arg_name(int id);  // "KT_ARG_X"; nullptr for unknown ids
std::string id_string(int id);  // arg_name, or "argument id N" for unknown ids

}  // namespace kt
