// safetensors files (https://github.com/huggingface/safetensors): read with pread into memory the
// object owns, written atomically. One include for both halves:
//   safetensors_format.h  the layout, limits and dtype names
//   safetensors_reader.h  SafetensorsFile: strict, hostile-file-proof reading
//   safetensors_writer.h  WriteSafetensors: atomic writing
#ifndef REFIT_DAEMON_MODEL_SAFETENSORS_H_
#define REFIT_DAEMON_MODEL_SAFETENSORS_H_

#include "daemon/model/safetensors_format.h"  // IWYU pragma: export
#include "daemon/model/safetensors_reader.h"  // IWYU pragma: export
#include "daemon/model/safetensors_writer.h"  // IWYU pragma: export

#endif  // REFIT_DAEMON_MODEL_SAFETENSORS_H_
