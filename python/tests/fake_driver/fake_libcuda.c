/* A stand-in for libcuda.so.1 with the CUDA driver API's real prototypes (from cuda.h, so a
 * signature refit/_cuda.py binds wrongly fails here or in the test): lets the tests drive
 * refit._cuda.Driver's ctypes marshaling (structs by value, out-pointers, versioned entry points,
 * context push/pop, error names) on a machine without a GPU. Two fake devices; "allocations"
 * are 1 MiB-aligned 1 MiB ranges; an IPC handle carries its base address and device; opening one
 * returns the base moved by IMPORT_SHIFT. Not a GPU: nothing is ever dereferenced. */
#include <cuda.h>
#include <string.h>

#define ALLOC_BYTES (1ull << 20)
#define IMPORT_SHIFT 0x100000000000ull
static const char kMagic[8] = "FAKEIPC";

static CUcontext current = 0;
static int open_mappings = 0;
static unsigned int last_open_flags = 0;

int fake_open_mappings(void) { return open_mappings; }
unsigned int fake_last_open_flags(void) { return last_open_flags; }

static int device_of(CUcontext ctx) { return (int)((unsigned long long)ctx - 0x1000); }

CUresult CUDAAPI cuInit(unsigned int flags) { return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }

CUresult CUDAAPI cuGetErrorName(CUresult error, const char** s) {
  switch (error) {
    case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; return CUDA_SUCCESS;
    default: *s = 0; return CUDA_ERROR_INVALID_VALUE;
  }
}

CUresult CUDAAPI cuGetErrorString(CUresult error, const char** s) {
  *s = error == CUDA_ERROR_INVALID_HANDLE ? "invalid resource handle" : "fake error";
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetCount(int* count) { *count = 2; return CUDA_SUCCESS; }

CUresult CUDAAPI cuDeviceGet(CUdevice* device, int ordinal) {
  if (ordinal < 0 || ordinal > 1) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetUuid(CUuuid* uuid, CUdevice dev) {  /* cuDeviceGetUuid_v2 */
  for (int i = 0; i < 16; ++i) uuid->bytes[i] = (char)(0x10 * (dev + 1) + i);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
  *ctx = (CUcontext)(0x1000ull + (unsigned long long)dev);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxPushCurrent(CUcontext ctx) {  /* _v2 */
  if (current != 0) return CUDA_ERROR_INVALID_CONTEXT;  /* the fake allows one level */
  current = ctx;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxPopCurrent(CUcontext* ctx) {  /* _v2 */
  if (current == 0) return CUDA_ERROR_INVALID_CONTEXT;
  *ctx = current;
  current = 0;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSynchronize(void) { return current ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT; }

CUresult CUDAAPI cuMemGetAddressRange(CUdeviceptr* base, size_t* size, CUdeviceptr ptr) {  /* _v2 */
  if (current == 0) return CUDA_ERROR_INVALID_CONTEXT;
  if (ptr == 0) return CUDA_ERROR_INVALID_VALUE;
  *base = ptr & ~(ALLOC_BYTES - 1);
  *size = ALLOC_BYTES;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcGetMemHandle(CUipcMemHandle* handle, CUdeviceptr ptr) {
  if (current == 0) return CUDA_ERROR_INVALID_CONTEXT;
  if (ptr & (ALLOC_BYTES - 1)) return CUDA_ERROR_INVALID_VALUE;  /* not an allocation's base */
  int dev = device_of(current);
  memset(handle->reserved, 0, sizeof handle->reserved);
  memcpy(handle->reserved, kMagic, 8);
  memcpy(handle->reserved + 8, &ptr, 8);
  memcpy(handle->reserved + 16, &dev, 4);
  handle->reserved[63] = 0x5a;  /* the last byte travels too */
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcOpenMemHandle(CUdeviceptr* ptr, CUipcMemHandle handle, unsigned int flags) {  /* _v2 */
  if (current == 0) return CUDA_ERROR_INVALID_CONTEXT;
  if (memcmp(handle.reserved, kMagic, 8) != 0 || handle.reserved[63] != 0x5a) {
    return CUDA_ERROR_INVALID_HANDLE;
  }
  int dev;
  memcpy(&dev, handle.reserved + 16, 4);
  if (dev != device_of(current)) return CUDA_ERROR_INVALID_DEVICE;
  CUdeviceptr base;
  memcpy(&base, handle.reserved + 8, 8);
  *ptr = base + IMPORT_SHIFT;
  last_open_flags = flags;
  ++open_mappings;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr ptr) {
  if (current == 0) return CUDA_ERROR_INVALID_CONTEXT;
  if (ptr < IMPORT_SHIFT) return CUDA_ERROR_INVALID_VALUE;
  --open_mappings;
  return CUDA_SUCCESS;
}
