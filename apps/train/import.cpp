// Published weights onto baton's models: see import.h. Values go through double (exact for
// every floating dtype a file holds), so a transpose, a shard's cut and the dtype conversion are
// one loop each and round at most once, when stored.
#include "import.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "baton/graph/safetensors.h"
#include "baton/graph/sharding.h"

namespace baton::models {

namespace {

/// Whether the file stores `name` as a torch Linear weight, [out, in], transposed from baton's.
bool stored_transposed(std::string_view layout, const std::string& name) {
  return layout == "llama" && (name.ends_with("_proj.weight") || name == "lm_head.weight");
}

std::vector<double> values_of(const Tensor& t) {
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  switch (t.dtype()) {
    case DType::f32:
      std::copy_n(t.data<float>().data(), v.size(), v.begin());
      break;
    case DType::f64:
      std::copy_n(t.data<double>().data(), v.size(), v.begin());
      break;
    case DType::bf16: {
      auto b = t.data<bfloat16>();
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = to_float(b[i]);
      break;
    }
    default:
      break;  // refused by the caller
  }
  return v;
}

Tensor tensor_of(const std::vector<double>& v, const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  for (std::size_t i = 0; i < v.size(); ++i) {
    switch (dtype) {
      case DType::f32:
        t.data<float>()[i] = static_cast<float>(v[i]);
        break;
      case DType::f64:
        t.data<double>()[i] = v[i];
        break;
      case DType::bf16:
        t.data<bfloat16>()[i] = to_bf16(static_cast<float>(v[i]));
        break;
      default:
        throw std::invalid_argument(
            fmt::format("init_from: a weight of dtype {} cannot be loaded", name(dtype)));
    }
  }
  return t;
}

/// [rows, cols] row-major -> [cols, rows].
std::vector<double> transposed(const std::vector<double>& v, std::int64_t rows, std::int64_t cols) {
  std::vector<double> out(v.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c)
      out[static_cast<std::size_t>(c * rows + r)] = v[static_cast<std::size_t>(r * cols + c)];
  }
  return out;
}

/// Piece k of `count` along `axis` of a row-major tensor of shape `whole`.
std::vector<double> piece(const std::vector<double>& v, const Shape& whole, std::size_t axis,
                          std::int64_t k, std::int64_t count) {
  std::int64_t outer = 1, inner = 1;
  for (std::size_t i = 0; i < axis; ++i) outer *= whole[i];
  for (std::size_t i = axis + 1; i < whole.size(); ++i) inner *= whole[i];
  const std::int64_t width = whole[axis] / count;
  std::vector<double> out;
  out.reserve(static_cast<std::size_t>(outer * width * inner));
  for (std::int64_t o = 0; o < outer; ++o) {
    const auto from =
        v.begin() + static_cast<std::ptrdiff_t>((o * whole[axis] + k * width) * inner);
    out.insert(out.end(), from, from + static_cast<std::ptrdiff_t>(width * inner));
  }
  return out;
}

struct Group {
  std::vector<std::pair<std::int64_t, std::string>> shards;  // (k, variable name); k = -1: whole
};

}  // namespace

void init_from(const std::filesystem::path& file, std::string_view layout, ParameterStore& params) {
  init_from(safetensors::read(file), file, layout, params);
}

void init_from(const safetensors::Contents& contents, const std::filesystem::path& file,
               std::string_view layout, ParameterStore& params) {
  auto fail = [&](const std::string& what) {
    throw std::invalid_argument(fmt::format("{}: {}", file.string(), what));
  };
  // The file's tensors by the model's names: GPT2LMHeadModel's state_dict says
  // "transformer.h.0...." where the published files (GPT2Model's) say "h.0....".
  std::map<std::string, const Tensor*> tensors;
  for (const auto& [name, t] : contents.tensors) {
    const std::string key =
        layout == "gpt2" && name.starts_with("transformer.") ? name.substr(12) : name;
    if (!tensors.emplace(key, &t).second)
      fail(fmt::format("tensor '{}' is in the file twice (as '{}' too)", key, name));
  }
  auto find = [&](const std::string& name) -> const Tensor* {
    auto it = tensors.find(name);
    return it == tensors.end() ? nullptr : it->second;
  };
  std::map<std::string, Group> groups;  // by the file's name
  for (const auto& [name, t] : params.values()) {
    auto [base, k] = tp_part_name(name);
    groups[base].shards.emplace_back(k, name);
  }
  std::map<std::string, bool> used;
  for (auto& [base, group] : groups) {
    std::sort(group.shards.begin(), group.shards.end());
    // Copied: setting a shard replaces the tensor a reference would name.
    const Shape model_shape = params.at(group.shards.front().second).shape();
    const DType model_dtype = params.at(group.shards.front().second).dtype();
    const bool transpose = stored_transposed(layout, base);
    const auto count = static_cast<std::int64_t>(group.shards.size());
    const Tensor* f = find(base);
    if (f == nullptr) {
      Shape want = model_shape;
      if (count > 1) want.clear();  // the shards' whole: not known until the file says
      if (transpose && want.size() == 2) std::swap(want[0], want[1]);
      fail(fmt::format("the model's weight '{}'{} is not in the file (--model {})", base,
                       want.empty() ? std::string() : " " + to_string(want), layout));
    }
    used[base] = true;
    if (!is_floating(f->dtype())) {
      fail(fmt::format("tensor '{}' is {} {}, not a floating dtype", base, name(f->dtype()),
                       to_string(f->shape())));
    }
    Shape whole = f->shape();
    std::vector<double> v = values_of(*f);
    if (transpose) {
      if (whole.size() != 2)
        fail(fmt::format("tensor '{}' is {}: a Linear weight [out, in] has two axes", base,
                         to_string(whole)));
      v = transposed(v, whole[0], whole[1]);
      std::swap(whole[0], whole[1]);
    }
    auto layout_of = [&](Shape s) {  // a shape as the file writes it
      if (transpose) std::swap(s[0], s[1]);
      return to_string(s);
    };
    if (count == 1 && group.shards.front().first < 0) {
      if (whole != model_shape) {
        fail(fmt::format("tensor '{}' is {} in the file but {} in the model{}", base,
                         layout_of(whole), layout_of(model_shape),
                         transpose ? " (a torch Linear weight, [out, in])" : ""));
      }
      params.set(base, tensor_of(v, whole, model_dtype));
      continue;
    }
    // Shards: the axis along which `count` of them make the file's tensor.
    std::optional<std::size_t> axis;
    for (std::size_t a = 0; a < whole.size() && model_shape.size() == whole.size(); ++a) {
      Shape s = model_shape;
      s[a] *= count;
      if (s == whole) axis = a;
    }
    if (!axis) {
      fail(fmt::format("tensor '{}' is {} in the file, which {} shards of {} do not make", base,
                       layout_of(whole), count, layout_of(model_shape)));
    }
    for (const auto& [k, name] : group.shards) {
      params.set(name, tensor_of(piece(v, whole, *axis, k, count), model_shape, model_dtype));
    }
  }
  for (const auto& [name, t] : tensors) {
    if (used.count(name) != 0) continue;
    // A tied head is the token table: a file may still carry it, as the same tensor.
    const Tensor* table = find(layout == "gpt2" ? "wte.weight" : "model.embed_tokens.weight");
    if (name == "lm_head.weight" && (layout == "llama" || layout == "gpt2") && table != nullptr &&
        table->shape() == t->shape() && table->dtype() == t->dtype() &&
        std::memcmp(table->raw(), t->raw(), t->nbytes()) == 0) {
      continue;
    }
    // GPT-2's causal masks, buffers that older files carry beside the weights.
    if (layout == "gpt2" && (name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")))
      continue;
    fail(fmt::format("tensor '{}' {} is no weight of the model (--model {}{})", name,
                     to_string(t->shape()), layout,
                     layout == "llama" && name == "lm_head.weight"
                         ? " with --tie-embeddings, whose head is the token table"
                     : name == "lm_head.weight" ? ", whose head is the token table"
                                                : ""));
  }
}

}  // namespace baton::models
