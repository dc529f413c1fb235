// The kernels "tpu" runs here rather than in tpud: tensor creation (memory
// from the caching allocator), resize_ and set_ (metadata, and storage
// growth), copies between host and device or across devices, and reads of
// one value (.item()). Views use ATen's own kernels (registration.cc).
#include "native_kernels.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/native/TensorFactories.h>
#include <c10/core/DeviceGuard.h>

#include "allocator.h"
#include "forwarding.h"
#include "runtime.h"
#include "wire.h"

namespace torch_tpu {
namespace {

at::Tensor& SetStorage(at::Tensor& self, at::Storage source, int64_t offset,
                       at::IntArrayRef size, at::IntArrayRef stride) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_storage_offset(offset);
  if (stride.empty()) {
    impl->set_sizes_contiguous(size);
  } else {
    impl->set_sizes_and_strides(size, stride);
  }
  return self;
}

uint64_t AddressOf(const at::Tensor& t) {
  return reinterpret_cast<uint64_t>(t.storage().data_ptr().get()) +
         static_cast<uint64_t>(t.storage_offset()) * t.element_size();
}

}  // namespace

at::Tensor EmptyStrided(at::IntArrayRef size, at::IntArrayRef stride,
                        at::ScalarType dtype, c10::DeviceIndex device) {
  c10::DeviceGuard guard(c10::Device(kTpu, device));
  return at::detail::empty_strided_generic(size, stride, GetTpuAllocator(),
                                           kTpuKeys, dtype);
}

// A ZeroTensor, made as CUDA makes it: no memory at all; the ZeroTensor key
// makes ops see zeros (autograd uses these for gradients known to be zero).
at::Tensor EfficientZeroTensor(at::IntArrayRef size,
                               std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>,
                               std::optional<at::Device> device,
                               std::optional<bool>) {
  const c10::DeviceIndex idx = device.has_value() && device->has_index()
                                   ? device->index()
                                   : CurrentDevice();
  at::native::ZeroTensorAllocator allocator(c10::Device(kTpu, idx));
  return at::detail::empty_generic(
      size, &allocator,
      kTpuKeys | c10::DispatchKeySet(c10::DispatchKey::ZeroTensor),
      dtype.value_or(at::get_default_dtype_as_scalartype()), std::nullopt);
}

at::Tensor Empty(at::IntArrayRef size, std::optional<at::ScalarType> dtype,
                 std::optional<at::Layout> layout,
                 std::optional<at::Device> device, std::optional<bool>,
                 std::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK(!layout.has_value() || *layout == at::kStrided,
              "tpu: only strided tensors");
  const c10::DeviceIndex idx = device.has_value() && device->has_index()
                                   ? device->index()
                                   : CurrentDevice();
  c10::DeviceGuard guard(c10::Device(kTpu, idx));
  return at::detail::empty_generic(
      size, GetTpuAllocator(), kTpuKeys,
      dtype.value_or(at::get_default_dtype_as_scalartype()), memory_format);
}

at::Tensor EmptyStridedNative(at::IntArrayRef size, at::IntArrayRef stride,
                              std::optional<at::ScalarType> dtype,
                              std::optional<at::Layout>,
                              std::optional<at::Device> device,
                              std::optional<bool>) {
  const c10::DeviceIndex idx = device.has_value() && device->has_index()
                                   ? device->index()
                                   : CurrentDevice();
  return EmptyStrided(
      size, stride, dtype.value_or(at::get_default_dtype_as_scalartype()), idx);
}

const at::Tensor& Resize(const at::Tensor& self, at::IntArrayRef size,
                         std::optional<at::MemoryFormat> memory_format) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  const size_t needed =
      static_cast<size_t>(self.storage_offset() + self.numel()) *
      self.element_size();
  if (needed > self.storage().nbytes()) ResizeStorage(self.storage(), needed);
  if (memory_format.has_value()) impl->empty_tensor_restride(*memory_format);
  return self;
}

at::Tensor& SetSource(at::Tensor& self, at::Storage source) {
  const int64_t n = static_cast<int64_t>(source.nbytes()) / self.element_size();
  return SetStorage(self, std::move(source), 0, {n}, {});
}

at::Tensor& SetSourceOffset(at::Tensor& self, at::Storage source,
                            c10::SymInt offset, c10::SymIntArrayRef size,
                            c10::SymIntArrayRef stride) {
  return SetStorage(self, std::move(source), offset.expect_int(),
                    C10_AS_INTARRAYREF_SLOW(size),
                    C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor& SetTensor(at::Tensor& self, const at::Tensor& src) {
  return SetStorage(self, src.storage(), src.storage_offset(), src.sizes(),
                    src.strides());
}

at::Tensor& SetEmpty(at::Tensor& self) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, GetTpuAllocator(),
                       true);
  return SetStorage(self, std::move(storage), 0, {0}, {});
}

at::Tensor Materialize(const at::Tensor& t) {
  at::Tensor out = t;
  if (out.is_conj())
    out = at::conj_physical(
        at::conj(out));  // conj() of a conj view clears the bit
  if (out.is_neg()) out = at::neg(at::_neg_view(out));
  return out;
}

at::Tensor CopyFrom(const at::Tensor& self_in, const at::Tensor& dst,
                    bool non_blocking) {
  tpu::Session& session = GetSession();
  if (dst.numel() == 0) return dst;
  const at::Tensor self =
      IsTpu(self_in) && (self_in.is_conj() || self_in.is_neg())
          ? Materialize(self_in)
          : self_in;
  if (IsTpu(dst) && !IsTpu(self)) {
    const int stream = SessionStream(CurrentStreamId(dst.device().index()));
    at::Tensor src = self.to(dst.scalar_type()).expand_as(dst).contiguous();
    if (dst.is_contiguous()) {
      Check(session.CopyToDevice(stream, AddressOf(dst), src.data_ptr(),
                                 src.nbytes()),
            "copy to device");
      if (session.IsPinned(src.data_ptr())) {
        // From pinned memory the daemon copies later, straight from the
        // source: wait, so the caller may reuse or free it at once. (A true
        // non_blocking copy would need the pinned block kept until then.)
        absl::StatusOr<tpu::Event> done = session.RecordEvent(stream);
        Check(done.status(), "copy to device");
        absl::Status waited = session.SynchronizeEvent(*done);
        session.ReleaseEvent(*done);
        Check(waited, "copy to device");
      }
      return dst;
    }
    at::Tensor tmp = EmptyStrided(src.sizes(), src.strides(), src.scalar_type(),
                                  dst.device().index());
    Check(session.CopyToDevice(stream, AddressOf(tmp), src.data_ptr(),
                               src.nbytes()),
          "copy to device");
    at::Tensor d = dst;
    ForwardInPlace("aten::copy_", "", d, {tmp, false});
    return dst;
  }
  if (!IsTpu(dst) && IsTpu(self)) {
    const int stream = SessionStream(CurrentStreamId(self.device().index()));
    at::Tensor src = self.is_contiguous() ? self : self.contiguous();
    const bool direct = dst.is_contiguous() &&
                        dst.scalar_type() == src.scalar_type() &&
                        dst.sizes() == src.sizes() && dst.device().is_cpu();
    at::Tensor host =
        direct ? dst : at::empty(src.sizes(), src.options().device(at::kCPU));
    Check(session.CopyToHost(stream, host.data_ptr(), AddressOf(src),
                             src.nbytes()),
          "copy to host");
    if (!direct) dst.copy_(host);
    return dst;
  }
  // Device to device.
  TORCH_CHECK(IsTpu(self) && IsTpu(dst), "tpu: unexpected copy from ",
              self.device(), " to ", dst.device());
  const int stream = SessionStream(CurrentStreamId(dst.device().index()));
  if (self.scalar_type() == dst.scalar_type() && self.sizes() == dst.sizes() &&
      self.is_contiguous() && dst.is_contiguous()) {
    Check(session.CopyOnDevice(stream, AddressOf(dst), AddressOf(self),
                               self.nbytes()),
          "device copy");
    return dst;
  }
  at::Tensor src = self;
  if (self.device() != dst.device()) {
    at::Tensor c = self.contiguous();
    src = EmptyStrided(c.sizes(), c.strides(), c.scalar_type(),
                       dst.device().index());
    Check(
        session.CopyOnDevice(stream, AddressOf(src), AddressOf(c), c.nbytes()),
        "device copy");
  }
  at::Tensor d = dst;
  c10::DeviceGuard guard(dst.device());
  ForwardInPlace("aten::copy_", "", d, {src, non_blocking});
  return dst;
}

at::Tensor CopyFromAndResize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) {
    if (IsTpu(dst)) {
      Resize(dst, self.sizes(), std::nullopt);
    } else {
      const_cast<at::Tensor&>(dst).resize_(self.sizes());
    }
  }
  return CopyFrom(self, dst, false);
}

// Whether `from`'s TensorImpl fields may be shallow-copied into `self`
// (`param.data = t`), which nn.Module.to() relies on to keep a Parameter's
// identity, and with it tied weights and optimizers made before the move.
// c10 answers true between its own dense backends only; tpu tensors are
// plain dense TensorImpls too, so they join that set.
bool HasCompatibleShallowCopyType(const at::Tensor& self,
                                  const at::Tensor& from) {
  auto is_dense = [](c10::DispatchKeySet ks) {
    constexpr auto backends = c10::DispatchKeySet(
        {c10::BackendComponent::CPUBit, c10::BackendComponent::CUDABit,
         c10::BackendComponent::MPSBit, c10::BackendComponent::HIPBit,
         c10::BackendComponent::XPUBit, c10::BackendComponent::HPUBit,
         c10::BackendComponent::MTIABit,
         c10::BackendComponent::PrivateUse1Bit});
    return ks.has_any(c10::DispatchKeySet(c10::DispatchKey::Dense)) &&
           ks.has_any(backends);
  };
  if (is_dense(self.key_set()) && is_dense(from.key_set())) return true;
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(
      from.key_set());
}

at::Scalar LocalScalarDense(const at::Tensor& self) {
  const uint32_t id = OpIdFor("aten::_local_scalar_dense", "");
  tpu::OpArg arg;
  arg.tag = tpu::ArgTag::kTensor;
  arg.tensor = RefOf(self);
  const int stream = SessionStream(CurrentStreamId(self.device().index()));
  absl::StatusOr<std::vector<tpu::OpResult>> r =
      GetSession().RunSync(stream, id, &arg, 1, nullptr, 0);
  Check(r.status(), "reading a value (.item())");
  TORCH_CHECK(!r->empty(), "tpu: _local_scalar_dense returned nothing");
  const tpu::OpResult& v = (*r)[0];
  switch (v.kind) {
    case tpu::OpResult::Kind::kInt:
      return at::Scalar(v.i);
    case tpu::OpResult::Kind::kUInt:
      return at::Scalar(static_cast<uint64_t>(v.i));
    case tpu::OpResult::Kind::kBool:
      return at::Scalar(v.b);
    case tpu::OpResult::Kind::kComplex:
      return at::Scalar(c10::complex<double>(v.d, v.d_imag));
    default:
      return at::Scalar(v.d);
  }
}

// Tensor.record_stream: the block is reused only after `stream` passed the
// point where the tensor was freed (see allocator.cc).
void RecordStream(at::Tensor& self, c10::Stream stream) {
  GetTpuAllocator()->recordStream(self.storage().data_ptr(), stream);
}

}  // namespace torch_tpu
