// baton-bench-train-libtorch: the C++ reference of baton-bench-train. The same models,
// optimizer, batch and threads as apps/bench/torch_reference.py, written with LibTorch's C++ API
// (torch::nn modules, torch::optim::Adam), so that the ratio against it is against PyTorch's
// kernels without Python's dispatch. Prints one JSON line, with the keys of torch_reference.py:
// {"case", "samples_per_s", "step_ms", "loss", "steps", "threads", "batch", "torch",
// "omp_wait_policy", "repeats", "weights"}.
//
//   baton-bench-train-libtorch --case mlp_b64 --model mlp --inputs 64 --hidden 256 --layers 2
//       --classes 10 --batch 64 --steps 500 --threads 1 [--weights FILE]
//   baton-bench-train-libtorch --case gpt_small --model gpt --vocab 64 --seq 32 --d-model 64
//       --heads 4 --layers 2 --batch 16 --steps 100
//
// --weights FILE: baton's initial weights (weights_file.h), loaded into every timed model, so
// that the runs start from baton's point; without it, the initialisation of torch_reference.py.
// The data are as torch_reference.py makes them (the same distributions as baton's, drawn with
// torch's generator). Set OMP_WAIT_POLICY before starting this program (libgomp reads it when
// it loads): baton-bench-train starts it with PASSIVE, as torch_reference.py sets for itself.
#include <torch/torch.h>
#include <torch/version.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "weights_file.h"

namespace {

struct Args {
  std::string case_name = "unnamed", model;
  std::int64_t batch = 0, steps = 0, warmup = 5, repeats = 1, seed = 1;
  int threads = 1;
  double lr = 1e-3;
  // mlp
  std::int64_t inputs = 64, hidden = 256, layers = 2, classes = 10;
  // gpt (layers shared)
  std::int64_t vocab = 64, seq = 32, d_model = 64, heads = 4;
  std::string weights;
};

[[noreturn]] void usage(int code, const std::string& why = {}) {
  if (!why.empty()) std::fprintf(stderr, "baton-bench-train-libtorch: %s\n", why.c_str());
  std::fprintf(code == 0 ? stdout : stderr,
               "usage: baton-bench-train-libtorch --model mlp|gpt --batch B --steps S [--case "
               "NAME] [--threads T]\n"
               "         [--warmup W] [--repeats R] [--lr X] [--seed N] [--weights FILE]\n"
               "         mlp: [--inputs N] [--hidden N] [--layers N] [--classes N]\n"
               "         gpt: [--vocab N] [--seq N] [--d-model N] [--heads N] [--layers N]\n");
  std::exit(code);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string_view k = argv[i];
    if (k == "-h" || k == "--help") usage(0);
    if (i + 1 >= argc) usage(2, std::string(k) + " needs a value (or is unknown)");
    const std::string v = argv[++i];
    auto integer = [&](std::int64_t min) {
      char* end = nullptr;
      const long long n = std::strtoll(v.c_str(), &end, 10);
      if (end == v.c_str() || *end != '\0' || n < min) {
        usage(2,
              std::string(k) + " wants an integer >= " + std::to_string(min) + ", not '" + v + "'");
      }
      return static_cast<std::int64_t>(n);
    };
    if (k == "--case")
      a.case_name = v;
    else if (k == "--model")
      a.model = v;
    else if (k == "--batch")
      a.batch = integer(1);
    else if (k == "--steps")
      a.steps = integer(1);
    else if (k == "--warmup")
      a.warmup = integer(0);
    else if (k == "--repeats")
      a.repeats = integer(1);
    else if (k == "--seed")
      a.seed = integer(0);
    else if (k == "--threads")
      a.threads = static_cast<int>(integer(1));
    else if (k == "--lr")
      a.lr = std::strtod(v.c_str(), nullptr);
    else if (k == "--inputs")
      a.inputs = integer(1);
    else if (k == "--hidden")
      a.hidden = integer(1);
    else if (k == "--layers")
      a.layers = integer(1);
    else if (k == "--classes")
      a.classes = integer(2);
    else if (k == "--vocab")
      a.vocab = integer(2);
    else if (k == "--seq")
      a.seq = integer(1);
    else if (k == "--d-model")
      a.d_model = integer(1);
    else if (k == "--heads")
      a.heads = integer(1);
    else if (k == "--weights")
      a.weights = v;
    else
      usage(2, "unknown argument '" + std::string(k) + "'");
  }
  if (a.model != "mlp" && a.model != "gpt") usage(2, "--model must be mlp or gpt");
  if (a.batch < 1 || a.steps < 1) usage(2, "--batch and --steps are required");
  if (a.model == "gpt" && a.d_model % a.heads != 0)
    usage(2, "--d-model must be a multiple of --heads");
  if (!(a.lr > 0)) usage(2, "--lr must be positive");
  return a;
}

// ---------------------------------------------------------------------------------------------
// Loading baton's weights

/// A model parameter and where its value is in baton's file (transposed for a Linear weight:
/// baton keeps [in, out], torch [out, in]).
struct Slot {
  std::string baton_name;
  torch::Tensor param;
  bool transpose = false;
};

void load(const std::vector<Slot>& slots,
          const std::map<std::string, baton::bench::NamedArray>& file, const std::string& path) {
  if (file.size() != slots.size()) {
    throw std::runtime_error(path + " holds " + std::to_string(file.size()) +
                             " tensors, the model has " + std::to_string(slots.size()) +
                             " parameters");
  }
  torch::NoGradGuard no_grad;
  for (const Slot& s : slots) {
    auto it = file.find(s.baton_name);
    if (it == file.end()) throw std::runtime_error(path + " has no tensor '" + s.baton_name + "'");
    auto& a = it->second;
    auto t = torch::from_blob(const_cast<float*>(a.data.data()), a.shape, torch::kFloat32);
    if (s.transpose) t = t.t();
    if (t.sizes() != s.param.sizes()) {
      throw std::runtime_error(path + ": '" + s.baton_name +
                               "' does not fit its parameter's shape");
    }
    s.param.copy_(t);
  }
}

// ---------------------------------------------------------------------------------------------
// The models (as torch_reference.py's)

struct MlpImpl : torch::nn::Module {
  MlpImpl(std::int64_t inputs, std::int64_t hidden, std::int64_t layers, std::int64_t classes) {
    std::vector<std::int64_t> dims{inputs};
    for (std::int64_t l = 0; l < layers; ++l) dims.push_back(hidden);
    dims.push_back(classes);
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i + 1 < dims.size(); ++i) {
      auto fc = register_module("fc" + std::to_string(i), torch::nn::Linear(dims[i], dims[i + 1]));
      // As torch_reference.py: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) weights, zero biases.
      const double bound = 1.0 / std::sqrt(static_cast<double>(dims[i]));
      fc->weight.uniform_(-bound, bound);
      fc->bias.zero_();
      fcs.push_back(fc);
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (std::size_t i = 0; i + 1 < fcs.size(); ++i) x = torch::relu(fcs[i](x));
    return fcs.back()(x);
  }
  std::vector<Slot> slots() {
    std::vector<Slot> out;
    for (std::size_t i = 0; i < fcs.size(); ++i) {
      const std::string name = i + 1 == fcs.size() ? "out" : "fc" + std::to_string(i);
      out.push_back({name + ".w", fcs[i]->weight, true});
      out.push_back({name + ".b", fcs[i]->bias, false});
    }
    return out;
  }
  std::vector<torch::nn::Linear> fcs;
};
TORCH_MODULE(Mlp);

struct BlockImpl : torch::nn::Module {
  BlockImpl(std::int64_t d, std::int64_t heads)
      : n_heads(heads),
        ln1(register_module("ln1",
                            torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(1e-5)))),
        wq(register_module("wq", torch::nn::Linear(torch::nn::LinearOptions(d, d).bias(false)))),
        wk(register_module("wk", torch::nn::Linear(torch::nn::LinearOptions(d, d).bias(false)))),
        wv(register_module("wv", torch::nn::Linear(torch::nn::LinearOptions(d, d).bias(false)))),
        wo(register_module("wo", torch::nn::Linear(torch::nn::LinearOptions(d, d).bias(false)))),
        ln2(register_module("ln2",
                            torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(1e-5)))),
        fc1(register_module("fc1", torch::nn::Linear(d, 4 * d))),
        fc2(register_module("fc2", torch::nn::Linear(4 * d, d))) {}

  torch::Tensor forward(torch::Tensor x, const torch::Tensor& mask) {
    const auto b = x.size(0), t = x.size(1), d = x.size(2), nh = n_heads, dh = d / nh;
    auto h = ln1(x);
    auto q = wq(h).view({b, t, nh, dh}).transpose(1, 2);  // [b, nh, t, dh]
    auto k = wk(h).view({b, t, nh, dh}).transpose(1, 2);
    auto v = wv(h).view({b, t, nh, dh}).transpose(1, 2);
    auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(dh)));
    att = att.masked_fill(mask, -std::numeric_limits<float>::infinity()).softmax(-1);
    auto o = torch::matmul(att, v);
    x = x + wo(o.transpose(1, 2).reshape({b, t, d}));
    return x + fc2(torch::gelu(fc1(ln2(x))));  // exact (erf) GELU, as baton's
  }
  void add_slots(std::vector<Slot>& out, std::int64_t l) {
    const std::string p = "h" + std::to_string(l) + ".";
    out.push_back({p + "ln1.g", ln1->weight, false});
    out.push_back({p + "ln1.b", ln1->bias, false});
    out.push_back({p + "attn.wq", wq->weight, true});
    out.push_back({p + "attn.wk", wk->weight, true});
    out.push_back({p + "attn.wv", wv->weight, true});
    out.push_back({p + "attn.wo", wo->weight, true});
    out.push_back({p + "ln2.g", ln2->weight, false});
    out.push_back({p + "ln2.b", ln2->bias, false});
    out.push_back({p + "mlp.w1", fc1->weight, true});
    out.push_back({p + "mlp.b1", fc1->bias, false});
    out.push_back({p + "mlp.w2", fc2->weight, true});
    out.push_back({p + "mlp.b2", fc2->bias, false});
  }
  std::int64_t n_heads;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear wq, wk, wv, wo;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  GptImpl(std::int64_t vocab, std::int64_t seq, std::int64_t d, std::int64_t heads,
          std::int64_t layers)
      : wte(register_module("wte", torch::nn::Embedding(vocab, d))),
        wpe(register_parameter("wpe", torch::zeros({seq, d}))),
        lnf(register_module("lnf",
                            torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(1e-5)))),
        head(register_module("head",
                             torch::nn::Linear(torch::nn::LinearOptions(d, vocab).bias(false)))),
        mask(register_buffer("mask", torch::triu(torch::ones({seq, seq}, torch::kBool), 1))) {
    for (std::int64_t l = 0; l < layers; ++l)
      blocks.push_back(register_module("h" + std::to_string(l), Block(d, heads)));
    // As torch_reference.py: N(0, 0.02) weights, zero biases, LayerNorm's unit gains.
    torch::NoGradGuard no_grad;
    for (auto& p : named_parameters()) {
      const std::string& name = p.key();
      if (name.find("ln") != std::string::npos) continue;
      if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0) {
        p.value().zero_();
      } else {
        p.value().normal_(0.0, 0.02);
      }
    }
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    auto x = wte(tokens) + wpe;
    for (auto& b : blocks) x = b(x, mask);
    return head(lnf(x));
  }
  std::vector<Slot> slots() {
    std::vector<Slot> out{{"wte", wte->weight, false}, {"wpe", wpe, false}};
    for (std::size_t l = 0; l < blocks.size(); ++l)
      blocks[l]->add_slots(out, static_cast<std::int64_t>(l));
    out.push_back({"lnf.g", lnf->weight, false});
    out.push_back({"lnf.b", lnf->bias, false});
    out.push_back({"head.w", head->weight, true});
    return out;
  }
  torch::nn::Embedding wte;
  torch::Tensor wpe;
  std::vector<Block> blocks;
  torch::nn::LayerNorm lnf;
  torch::nn::Linear head;
  torch::Tensor mask;
};
TORCH_MODULE(Gpt);

// ---------------------------------------------------------------------------------------------
// Data (as torch_reference.py's)

/// Features ~ N(0, 1), labels = argmax(features @ teacher); shuffled epochs of batches.
class SyntheticBatches {
 public:
  SyntheticBatches(std::int64_t batch, std::int64_t width, std::int64_t classes, std::uint64_t seed)
      : batch_(batch), gen_(at::detail::createCPUGenerator(seed)) {
    constexpr std::int64_t rows = 4096;
    auto x = torch::randn({rows, width}, gen_);
    auto teacher = torch::randn({width, classes}, gen_);
    auto y = x.matmul(teacher).argmax(1);
    const auto n = rows - static_cast<std::int64_t>(std::llround(0.2 * rows));
    x_ = x.slice(0, 0, n).contiguous();
    y_ = y.slice(0, 0, n).contiguous();
  }
  std::pair<torch::Tensor, torch::Tensor> next() {
    std::vector<torch::Tensor> idx;
    std::int64_t need = batch_;
    while (need > 0) {
      if (pos_ >= order_.numel()) {
        order_ = torch::randperm(x_.size(0), gen_, torch::kLong);
        pos_ = 0;
      }
      const auto take = std::min(need, order_.numel() - pos_);
      idx.push_back(order_.slice(0, pos_, pos_ + take));
      pos_ += take;
      need -= take;
    }
    const auto i = idx.size() == 1 ? idx[0] : torch::cat(idx);
    return {x_.index_select(0, i), y_.index_select(0, i)};
  }

 private:
  std::int64_t batch_;
  at::Generator gen_;
  torch::Tensor x_, y_, order_ = torch::empty({0}, torch::kLong);
  std::int64_t pos_ = 0;
};

class RandomTokens {
 public:
  RandomTokens(std::int64_t batch, std::int64_t seq, std::int64_t vocab, std::uint64_t seed)
      : batch_(batch), seq_(seq), vocab_(vocab), gen_(at::detail::createCPUGenerator(seed)) {}
  std::pair<torch::Tensor, torch::Tensor> next() {
    auto w = torch::randint(0, vocab_, {batch_, seq_ + 1}, gen_, torch::kLong);
    return {w.slice(1, 0, seq_), w.slice(1, 1, seq_ + 1).reshape({-1})};
  }

 private:
  std::int64_t batch_, seq_, vocab_;
  at::Generator gen_;
};

// ---------------------------------------------------------------------------------------------
// Training

/// A model, its optimizer and its data, ready to step.
struct Trainer {
  std::function<std::pair<torch::Tensor, torch::Tensor>()> next;
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> loss;
  std::vector<torch::Tensor> params;
};

Trainer make(const Args& a, const std::map<std::string, baton::bench::NamedArray>* weights) {
  Trainer t;
  const auto seed = static_cast<std::uint64_t>(a.seed);
  if (a.model == "mlp") {
    Mlp model(a.inputs, a.hidden, a.layers, a.classes);
    if (weights != nullptr) load(model->slots(), *weights, a.weights);
    auto data = std::make_shared<SyntheticBatches>(a.batch, a.inputs, a.classes, seed);
    t.next = [data] { return data->next(); };
    t.loss = [model](const torch::Tensor& x, const torch::Tensor& y) mutable {
      return torch::nn::functional::cross_entropy(model(x), y);
    };
    t.params = model->parameters();
  } else {
    Gpt model(a.vocab, a.seq, a.d_model, a.heads, a.layers);
    if (weights != nullptr) load(model->slots(), *weights, a.weights);
    auto data = std::make_shared<RandomTokens>(a.batch, a.seq, a.vocab, seed);
    t.next = [data] { return data->next(); };
    const auto vocab = a.vocab;
    t.loss = [model, vocab](const torch::Tensor& tokens, const torch::Tensor& targets) mutable {
      return torch::nn::functional::cross_entropy(model(tokens).view({-1, vocab}), targets);
    };
    t.params = model->parameters();
  }
  return t;
}

torch::Tensor train(Trainer& t, torch::optim::Adam& opt, std::int64_t steps) {
  torch::Tensor loss;
  for (std::int64_t i = 0; i < steps; ++i) {
    auto [x, y] = t.next();
    opt.zero_grad();
    loss = t.loss(x, y);
    loss.backward();
    opt.step();
  }
  return loss;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    // Before any work: intra-op threads as asked, one inter-op thread (as torch_reference.py).
    torch::set_num_threads(a.threads);
    at::set_num_interop_threads(1);
    std::optional<std::map<std::string, baton::bench::NamedArray>> weights;
    if (!a.weights.empty()) weights = baton::bench::read_weights(a.weights);
    const auto* w = weights ? &*weights : nullptr;
    torch::manual_seed(static_cast<std::uint64_t>(a.seed));
    if (a.warmup > 0) {  // a throwaway model, so the timed one starts from initialization
      Trainer t = make(a, w);
      torch::optim::Adam opt(t.params, torch::optim::AdamOptions(a.lr));
      train(t, opt, a.warmup);
    }
    double wall = std::numeric_limits<double>::infinity(), final_loss = NAN;
    for (std::int64_t r = 0; r < a.repeats; ++r) {
      torch::manual_seed(static_cast<std::uint64_t>(a.seed));
      Trainer t = make(a, w);
      torch::optim::Adam opt(t.params, torch::optim::AdamOptions(a.lr));
      const auto t0 = std::chrono::steady_clock::now();
      auto loss = train(t, opt, a.steps);
      final_loss = loss.item<double>();
      wall = std::min(wall,
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    std::printf(
        "{\"case\": \"%s\", \"samples_per_s\": %.6g, \"step_ms\": %.6g, \"loss\": %.6g, \"steps\": "
        "%lld, "
        "\"threads\": %d, \"batch\": %lld, \"torch\": \"%d.%d.%d\", \"omp_wait_policy\": \"%s\", "
        "\"repeats\": %lld, "
        "\"weights\": \"%s\"}\n",
        a.case_name.c_str(), static_cast<double>(a.steps * a.batch) / wall,
        wall * 1e3 / static_cast<double>(a.steps), final_loss, static_cast<long long>(a.steps),
        torch::get_num_threads(), static_cast<long long>(a.batch), TORCH_VERSION_MAJOR,
        TORCH_VERSION_MINOR, TORCH_VERSION_PATCH, policy != nullptr ? policy : "",
        static_cast<long long>(a.repeats), weights ? "baton" : "own");
    std::fflush(stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "baton-bench-train-libtorch: %s\n", e.what());
    return 1;
  }
}
