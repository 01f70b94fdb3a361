/* C helpers shared by the package's cgo preambles (static: each preamble
 * compiles its own copy). Go memory handed to C must not contain Go pointers,
 * so tensors cross as plain descriptions (ktgo_arg) plus their data pointers,
 * and the DLTensors and kt_args are built on the C side. */
#ifndef KTGO_H_
#define KTGO_H_

#include <stdint.h>
#include <string.h>
#include <kt_c_api.h>

enum { KTGO_MAX_ARGS = 16, KTGO_MAX_DIMS = 4 };

typedef struct ktgo_arg {
	int id;
	int code;
	int bits;
	int ndim;
	int64_t shape[KTGO_MAX_DIMS];
} ktgo_arg;

static inline void ktgo_fill(int n, const ktgo_arg* meta, void* const* data, DLTensor* tensors,
                             int64_t (*shapes)[KTGO_MAX_DIMS], kt_arg* args) {
	for (int i = 0; i < n; ++i) {
		memset(&tensors[i], 0, sizeof(tensors[i]));
		memcpy(shapes[i], meta[i].shape, sizeof(shapes[i]));
		tensors[i].data = data[i];
		tensors[i].device.device_type = kDLCPU;
		tensors[i].ndim = meta[i].ndim;
		tensors[i].dtype.code = (uint8_t)meta[i].code;
		tensors[i].dtype.bits = (uint8_t)meta[i].bits;
		tensors[i].dtype.lanes = 1;
		tensors[i].shape = shapes[i];
		args[i].id = meta[i].id;
		args[i].tensor = &tensors[i];
	}
}

#endif
