// The kernels "tpu" runs in this process instead of forwarding them to tpud
// (creation, resize_, set_, copies, scalar reads; registration.cc registers
// them), and the helpers for tpu tensors that the forwarding path shares.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/Scalar.h>
#include <c10/core/Storage.h>
#include <c10/core/Stream.h>

#include <optional>

namespace torch_tpu {

inline constexpr c10::DeviceType kTpu = c10::DeviceType::PrivateUse1;
inline const c10::DispatchKeySet kTpuKeys(c10::DispatchKey::PrivateUse1);

inline bool IsTpu(const at::Tensor& t) {
  return t.defined() && t.device().type() == kTpu;
}

// A new tpu tensor on `device`, its memory from the caching allocator.
at::Tensor EmptyStrided(at::IntArrayRef size, at::IntArrayRef stride,
                        at::ScalarType dtype, c10::DeviceIndex device);
// A tpu tensor with a lazy conjugate or negative bit, materialized on the
// device (the wire format carries plain data only).
at::Tensor Materialize(const at::Tensor& t);

// The kernels, by the ATen op each serves.
// _efficientzerotensor
at::Tensor EfficientZeroTensor(at::IntArrayRef size,
                               std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>,
                               std::optional<at::Device> device,
                               std::optional<bool>);
// empty.memory_format
at::Tensor Empty(at::IntArrayRef size, std::optional<at::ScalarType> dtype,
                 std::optional<at::Layout> layout,
                 std::optional<at::Device> device, std::optional<bool>,
                 std::optional<at::MemoryFormat> memory_format);
// empty_strided
at::Tensor EmptyStridedNative(at::IntArrayRef size, at::IntArrayRef stride,
                              std::optional<at::ScalarType> dtype,
                              std::optional<at::Layout>,
                              std::optional<at::Device> device,
                              std::optional<bool>);
// resize_ (the forwarding path also resizes out= tensors with it)
const at::Tensor& Resize(const at::Tensor& self, at::IntArrayRef size,
                         std::optional<at::MemoryFormat> memory_format);
// set_.source_Storage, set_.source_Storage_storage_offset, set_.source_Tensor,
// set_
at::Tensor& SetSource(at::Tensor& self, at::Storage source);
at::Tensor& SetSourceOffset(at::Tensor& self, at::Storage source,
                            c10::SymInt offset, c10::SymIntArrayRef size,
                            c10::SymIntArrayRef stride);
at::Tensor& SetTensor(at::Tensor& self, const at::Tensor& src);
at::Tensor& SetEmpty(at::Tensor& self);
// _copy_from, _copy_from_and_resize
at::Tensor CopyFrom(const at::Tensor& self_in, const at::Tensor& dst,
                    bool non_blocking);
at::Tensor CopyFromAndResize(const at::Tensor& self, const at::Tensor& dst);
// _has_compatible_shallow_copy_type
bool HasCompatibleShallowCopyType(const at::Tensor& self,
                                  const at::Tensor& from);
// _local_scalar_dense (.item())
at::Scalar LocalScalarDense(const at::Tensor& self);
// record_stream
void RecordStream(at::Tensor& self, c10::Stream stream);

}  // namespace torch_tpu
