#include "plan.h"

#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <tuple>

#include <fmt/format.h>

#include "baton/transport/control.h"
#include "baton/transport/link.h"

namespace baton::launch {

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::optional<std::uint32_t> parse_count(std::string_view text) {
  std::uint32_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) return std::nullopt;
  return value;
}

std::vector<std::string_view> split_words(std::string_view text) {
  std::vector<std::string_view> words;
  while (true) {
    text = trim(text);
    if (text.empty()) break;
    auto end = std::find_if(text.begin(), text.end(),
                            [](char c) { return std::isspace(static_cast<unsigned char>(c)); });
    const auto length = static_cast<std::size_t>(end - text.begin());
    words.push_back(text.substr(0, length));
    text.remove_prefix(length);
  }
  return words;
}

bool is_loopback_name(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

/// "host:port" from --master or $BATON_MASTER, as a UsageError naming where it came from.
std::pair<std::string, std::uint16_t> parse_master(const std::string& text,
                                                   const std::string& origin) {
  try {
    return transport::parse_endpoint(text);
  } catch (const std::exception& e) {
    throw UsageError(fmt::format("{} '{}' is not HOST:PORT ({})", origin, text, e.what()));
  }
}

std::uint32_t checked_count(std::int64_t value, const char* option, std::int64_t low) {
  if (value < low || value > 65535) {
    throw UsageError(fmt::format("{} must be between {} and 65535, not {}", option, low, value));
  }
  return static_cast<std::uint32_t>(value);
}

std::optional<std::uint32_t> env_count(const Environment& env, const char* name) {
  const auto text = env(name);
  if (!text) return std::nullopt;
  const auto value = parse_count(trim(*text));
  if (!value) throw UsageError(fmt::format("${}='{}' is not a number", name, *text));
  return value;
}

}  // namespace

Environment process_environment() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (!value) return std::nullopt;
    return std::string(value);
  };
}

std::vector<HostEntry> parse_hostfile(std::string_view text, const std::string& origin) {
  std::vector<HostEntry> hosts;
  int line_number = 0;
  while (!text.empty()) {
    ++line_number;
    const auto newline = text.find('\n');
    std::string_view line = text.substr(0, newline);
    text.remove_prefix(newline == std::string_view::npos ? text.size() : newline + 1);
    if (const auto hash = line.find('#'); hash != std::string_view::npos)
      line = line.substr(0, hash);
    const auto words = split_words(line);
    if (words.empty()) continue;
    HostEntry entry{std::string(words[0]), std::nullopt};
    for (std::size_t i = 1; i < words.size(); ++i) {
      const auto word = words[i];
      const auto eq = word.find('=');
      const auto key = word.substr(0, eq);
      const auto value = eq == std::string_view::npos ? std::string_view() : word.substr(eq + 1);
      if (key == "slots") {
        const auto slots = parse_count(value);
        if (!slots || *slots == 0) {
          throw UsageError(fmt::format("{}:{}: 'slots={}' must be a positive number", origin,
                                       line_number, value));
        }
        entry.slots = slots;
      } else if (key == "max_slots" || key == "max-slots") {
        // OpenMPI's oversubscription limit: nothing to do for us.
      } else {
        throw UsageError(fmt::format("{}:{}: '{}' is not understood (expected HOST [slots=N])",
                                     origin, line_number, word));
      }
    }
    hosts.push_back(std::move(entry));
  }
  return hosts;
}

std::vector<HostEntry> parse_host_list(std::string_view text) {
  std::vector<HostEntry> hosts;
  while (true) {
    const auto comma = text.find(',');
    const auto item = trim(text.substr(0, comma));
    if (item.empty()) throw UsageError(fmt::format("--hosts '{}': an empty host name", text));
    HostEntry entry{std::string(item), std::nullopt};
    // "h:N" as in mpirun's --host; an IPv6 address (two or more colons) is left alone.
    if (const auto colon = item.rfind(':');
        colon != std::string_view::npos && item.find(':') == colon) {
      const auto slots = parse_count(item.substr(colon + 1));
      if (!slots || *slots == 0) {
        throw UsageError(
            fmt::format("--hosts: '{}': the slots after ':' must be a positive number", item));
      }
      entry = HostEntry{std::string(item.substr(0, colon)), slots};
    }
    hosts.push_back(std::move(entry));
    if (comma == std::string_view::npos) break;
    text.remove_prefix(comma + 1);
  }
  return hosts;
}

std::string first_slurm_host(std::string_view nodelist) {
  // The first item at bracket depth 0.
  int depth = 0;
  std::size_t end = 0;
  for (; end < nodelist.size(); ++end) {
    if (nodelist[end] == '[') ++depth;
    if (nodelist[end] == ']') --depth;
    if (nodelist[end] == ',' && depth == 0) break;
  }
  const auto item = trim(nodelist.substr(0, end));
  const auto open = item.find('[');
  if (open == std::string_view::npos) return std::string(item);
  const auto close = item.find(']', open);
  if (close == std::string_view::npos) return std::string(item);
  auto range = item.substr(open + 1, close - open - 1);
  range = range.substr(0, range.find(','));
  range = range.substr(0, range.find('-'));
  return fmt::format("{}{}{}", item.substr(0, open), range, item.substr(close + 1));
}

std::optional<SchedulerLayout> detect_scheduler(const Environment& env) {
  SchedulerLayout layout;
  if (env("OMPI_COMM_WORLD_RANK") && env("OMPI_COMM_WORLD_SIZE")) {
    layout.name = "OpenMPI";
    layout.rank = *env_count(env, "OMPI_COMM_WORLD_RANK");
    layout.size = *env_count(env, "OMPI_COMM_WORLD_SIZE");
    layout.local_rank = env_count(env, "OMPI_COMM_WORLD_LOCAL_RANK").value_or(0);
    layout.local_size = env_count(env, "OMPI_COMM_WORLD_LOCAL_SIZE");
    for (const char* name :
         {"OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "OMPI_MCA_orte_ess_jobid"}) {
      if (auto id = env(name); id && !id->empty()) {
        layout.job_id = *id;
        break;
      }
    }
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS") &&
             (env("SLURM_STEP_ID") || env("SLURM_STEPID"))) {
    layout.name = "Slurm";
    layout.rank = *env_count(env, "SLURM_PROCID");
    layout.size = *env_count(env, "SLURM_NTASKS");
    layout.local_rank = env_count(env, "SLURM_LOCALID").value_or(0);
    // SLURM_NTASKS_PER_NODE is set only when the user asked for it; srun always sets the step's
    // own count, SLURM_STEP_TASKS_PER_NODE: "2" (one node, or one count), "2(x3)" (three nodes
    // of 2). A list of different counts ("2,1") leaves the local size unknown.
    if (auto per_node = env("SLURM_NTASKS_PER_NODE")) {
      layout.local_size = parse_count(trim(*per_node));
    } else if (auto step = env("SLURM_STEP_TASKS_PER_NODE")) {
      std::string_view count = trim(*step);
      if (const auto x = count.find("(x"); x != std::string_view::npos && count.ends_with(")")) {
        count = count.substr(0, x);
      }
      layout.local_size = parse_count(count);
    }
    if (auto job = env("SLURM_JOB_ID")) {
      const auto step = env("SLURM_STEP_ID") ? env("SLURM_STEP_ID") : env("SLURM_STEPID");
      layout.job_id = step ? fmt::format("{}.{}", *job, *step) : *job;
    }
    if (auto nodes =
            env("SLURM_STEP_NODELIST") ? env("SLURM_STEP_NODELIST") : env("SLURM_JOB_NODELIST")) {
      layout.first_host = first_slurm_host(*nodes);
    }
  } else {
    return std::nullopt;
  }
  if (layout.size == 0 || layout.rank >= layout.size) {
    throw UsageError(fmt::format("{}: task {} of {} tasks is out of range", layout.name,
                                 layout.rank, layout.size));
  }
  return layout;
}

std::string join_endpoint(const std::string& host, std::uint16_t port) {
  if (host.find(':') != std::string::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

bool is_this_host(const std::string& host) {
  if (is_loopback_name(host)) return true;
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) == 0) {
    const std::string own(name);
    if (host == own || host == own.substr(0, own.find('.')) ||
        own == host.substr(0, host.find('.')))
      return true;
  }
  // A name or address of one of our interfaces.
  std::set<std::string> local;
  ifaddrs* interfaces = nullptr;
  if (::getifaddrs(&interfaces) == 0) {
    for (auto* i = interfaces; i; i = i->ifa_next) {
      if (!i->ifa_addr || (i->ifa_addr->sa_family != AF_INET && i->ifa_addr->sa_family != AF_INET6))
        continue;
      char text[NI_MAXHOST];
      const socklen_t size =
          i->ifa_addr->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
      if (::getnameinfo(i->ifa_addr, size, text, sizeof text, nullptr, 0, NI_NUMERICHOST) == 0)
        local.insert(text);
    }
    ::freeifaddrs(interfaces);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  bool match = false;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) == 0) {
    for (auto* a = found; a && !match; a = a->ai_next) {
      char text[NI_MAXHOST];
      if (::getnameinfo(a->ai_addr, a->ai_addrlen, text, sizeof text, nullptr, 0, NI_NUMERICHOST) !=
          0)
        continue;
      const std::string address(text);
      match = local.count(address) > 0 || is_loopback_name(address);
    }
    ::freeaddrinfo(found);
  }
  return match;
}

ThisMachine this_machine() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) std::strcpy(name, "localhost");
  return ThisMachine{is_this_host, name};
}

namespace {
Plan resolve_layout(const CommandLine& cli, const Environment& env, const ThisMachine& machine);
}  // namespace

Plan resolve_plan(const CommandLine& cli, const Environment& env, const ThisMachine& machine) {
  Plan plan = resolve_layout(cli, env, machine);
  // --bind: the user names the interface. Only node 0 listens; the others just pass it on.
  if (!cli.bind.empty()) {
    if (cli.bind.find_first_of(" \t/") != std::string::npos || cli.bind.front() == '[') {
      throw UsageError(fmt::format("--bind '{}': expected an address or host name (e.g. 10.0.0.1, ::1, node0)",
                                   cli.bind));
    }
    plan.bind_host = cli.bind;
  }
  return plan;
}

namespace {

Plan resolve_layout(const CommandLine& cli, const Environment& env, const ThisMachine& machine) {
  if (cli.program.empty())
    throw UsageError("no program to run: baton-launch [OPTIONS] -- PROGRAM [ARGS...]");
  Plan plan;
  plan.program = cli.program;
  plan.finish_timeout = cli.finish_timeout;
  plan.join_timeout = cli.join_timeout;
  plan.trace = cli.trace;
  plan.token = !cli.token.empty() ? cli.token : env("BATON_JOB_TOKEN").value_or("");
  if (cli.nproc_per_node)
    plan.nproc_per_node = checked_count(*cli.nproc_per_node, "--nproc-per-node", 1);

  const bool hosts_mode = !cli.hosts.empty() || !cli.hostfile.empty();
  if (!cli.hosts.empty() && !cli.hostfile.empty())
    throw UsageError("--hosts and --hostfile: give only one of them");
  if (hosts_mode && (cli.nnodes || cli.node_rank)) {
    throw UsageError(fmt::format("{} decides the nodes: leave out --nnodes and --node-rank",
                                 cli.hosts.empty() ? "--hostfile" : "--hosts"));
  }

  if (hosts_mode) {
    std::vector<HostEntry> hosts;
    std::string origin;
    if (!cli.hosts.empty()) {
      origin = "--hosts";
      hosts = parse_host_list(cli.hosts);
    } else {
      origin = fmt::format("--hostfile {}", cli.hostfile);
      std::FILE* file = std::fopen(cli.hostfile.c_str(), "r");
      if (!file)
        throw UsageError(
            fmt::format("--hostfile: cannot read '{}': {}", cli.hostfile, std::strerror(errno)));
      std::string text;
      char buffer[4096];
      for (std::size_t n; (n = std::fread(buffer, 1, sizeof buffer, file)) > 0;)
        text.append(buffer, n);
      const bool failed = std::ferror(file);
      std::fclose(file);
      if (failed) throw UsageError(fmt::format("--hostfile: cannot read '{}'", cli.hostfile));
      hosts = parse_hostfile(text, cli.hostfile);
      if (hosts.empty())
        throw UsageError(fmt::format("--hostfile: '{}' names no hosts", cli.hostfile));
    }
    if (hosts.size() > 65535) throw UsageError(fmt::format("{}: too many hosts", origin));
    if (!machine.is_local_host(hosts[0].host)) {
      throw UsageError(
          fmt::format("{}: the first host, '{}', is not this machine ('{}'): baton-launch runs "
                      "node 0 itself and starts the "
                      "others over ssh, so run it on '{}' or put this machine first",
                      origin, hosts[0].host, machine.host_name, hosts[0].host));
    }
    if (!cli.nproc_per_node) {
      std::set<std::uint32_t> slots;
      for (const auto& h : hosts) {
        if (h.slots) slots.insert(*h.slots);
      }
      if (slots.size() > 1) {
        throw UsageError(fmt::format(
            "{}: the hosts have different slots ({}); baton-launch starts the same number of "
            "ranks on every host: make them equal or give --nproc-per-node",
            origin, fmt::join(slots, ", ")));
      }
      if (!slots.empty()) plan.nproc_per_node = *slots.begin();
    }
    plan.nnodes = static_cast<std::uint32_t>(hosts.size());
    for (std::size_t i = 1; i < hosts.size(); ++i) plan.remote_hosts.push_back(hosts[i].host);
    plan.master_host = hosts[0].host;
    if (!cli.master.empty())
      std::tie(plan.master_host, plan.bind_port) = parse_master(cli.master, "--master");
    // The other hosts must reach node 0: "localhost" means something else there.
    const bool all_loopback = std::all_of(
        hosts.begin(), hosts.end(), [](const HostEntry& h) { return is_loopback_name(h.host); });
    if (is_loopback_name(plan.master_host) && !all_loopback) plan.master_host = machine.host_name;
    // "localhost" may resolve to ::1 first while the server listens on 127.0.0.1.
    if (plan.master_host == "localhost") plan.master_host = "127.0.0.1";
    plan.bind_host = is_loopback_name(plan.master_host)
                         ? (plan.master_host == "::1" ? "::1" : "127.0.0.1")
                         : "0.0.0.0";
  } else if (cli.nnodes || cli.node_rank || !cli.master.empty()) {
    plan.nnodes = checked_count(cli.nnodes.value_or(1), "--nnodes", 1);
    if (cli.node_rank && (*cli.node_rank < 0 || *cli.node_rank >= plan.nnodes)) {
      throw UsageError(
          fmt::format("--node-rank {} is out of range: --nnodes {} gives nodes 0 to {}",
                      *cli.node_rank, plan.nnodes, plan.nnodes - 1));
    }
    plan.node_rank = static_cast<std::uint32_t>(cli.node_rank.value_or(0));
    std::string master = cli.master, origin = "--master";
    if (master.empty()) {
      master = env("BATON_MASTER").value_or("");
      origin = "$BATON_MASTER";
    }
    if (master.empty() && plan.nnodes > 1) {
      throw UsageError(
          fmt::format("--nnodes {} needs --master HOST:PORT (node 0's address and the port of its "
                      "rendezvous server), or $BATON_MASTER",
                      plan.nnodes));
    }
    if (!master.empty()) {
      std::tie(plan.master_host, plan.bind_port) = parse_master(master, origin);
      if (plan.bind_port == 0 && plan.nnodes > 1) {
        throw UsageError(
            fmt::format("{} '{}': the nodes need a fixed port, not 0", origin, master));
      }
      plan.master = master;
      plan.bind_host = is_loopback_name(plan.master_host)
                           ? (plan.master_host == "::1" ? "::1" : "127.0.0.1")
                           : "0.0.0.0";
    }
    plan.hand_out_token = plan.token.empty() && plan.nnodes > 1;
  } else if (auto scheduler = detect_scheduler(env)) {
    plan.scheduler = scheduler->name;
    plan.nnodes = scheduler->size;
    plan.node_rank = scheduler->rank;
    plan.local_rank_base = scheduler->local_rank * plan.nproc_per_node;
    plan.local_world_size = scheduler->local_size.value_or(1) * plan.nproc_per_node;
    if (plan.nnodes > 1) {
      std::string master = env("BATON_MASTER").value_or("");
      std::string origin = "$BATON_MASTER";
      if (master.empty()) {
        master = join_endpoint(scheduler->first_host.empty() ? "127.0.0.1" : scheduler->first_host,
                               29500);
        origin = fmt::format("the {} default master", scheduler->name);
      }
      std::tie(plan.master_host, plan.bind_port) = parse_master(master, origin);
      plan.master = join_endpoint(plan.master_host, plan.bind_port);
      plan.bind_host = is_loopback_name(plan.master_host) ? "127.0.0.1" : "0.0.0.0";
      if (plan.token.empty() && !scheduler->job_id.empty()) {
        std::string name = scheduler->name;
        std::transform(name.begin(), name.end(), name.begin(),
                       [](unsigned char c) { return std::tolower(c); });
        plan.token = fmt::format("{}-job-{}", name, scheduler->job_id);
      }
      plan.hand_out_token = plan.token.empty();
    }
    return plan;
  }
  plan.local_world_size = plan.nproc_per_node;
  if (std::uint64_t{plan.nnodes} * plan.nproc_per_node > 1'000'000) {
    throw UsageError(
        fmt::format("{} nodes x {} ranks is too many", plan.nnodes, plan.nproc_per_node));
  }
  return plan;
}

}  // namespace

std::string shell_quote(std::string_view word) {
  const bool plain = !word.empty() && std::all_of(word.begin(), word.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || std::strchr("-_./=:,@%+", c) != nullptr;
  });
  if (plain) return std::string(word);
  std::string out = "'";
  for (char c : word) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  out += '\'';
  return out;
}

std::string remote_command(const Plan& plan, std::uint32_t node, const std::string& master,
                           const std::string& token, const std::string& self_path,
                           const std::string& cwd, const std::vector<std::string>& forward) {
  std::string env;
  for (const auto& word : forward) env += fmt::format("{} ", shell_quote(word));
  std::string command = fmt::format(
      "cd {} && exec {}{}{} --nnodes {} --node-rank {} --master {} --token {} --nproc-per-node {}{} --",
      shell_quote(cwd), env.empty() ? "" : "env ", env, shell_quote(self_path), plan.nnodes, node,
      shell_quote(master), shell_quote(token), plan.nproc_per_node,
      plan.max_restarts > 0 ? fmt::format(" --max-restarts {}", plan.max_restarts) : std::string());
  for (const auto& word : plan.program) {
    command += ' ';
    command += shell_quote(word);
  }
  return command;
}

std::vector<std::string> forwarded_environment(const std::vector<std::string>& environ_words) {
  static const std::set<std::string, std::less<>> per_rank = {
      "BATON_RANK",      "BATON_WORLD_SIZE", "BATON_LOCAL_RANK", "BATON_LOCAL_WORLD_SIZE",
      "BATON_NODE_RANK", "BATON_MASTER",     "BATON_JOB_TOKEN",  "BATON_SSH",
      "BATON_REJOIN"};
  std::vector<std::string> out;
  for (const auto& word : environ_words) {
    const auto eq = word.find('=');
    if (eq == std::string::npos || eq == 0) continue;
    const std::string_view name(word.data(), eq);
    if (!(name.starts_with("UCX_") || name.starts_with("BATON_")) || per_rank.contains(name)) continue;
    out.push_back(word);
  }
  return out;
}

std::vector<std::string> ssh_prefix(const Environment& env) {
  std::vector<std::string> prefix;
  if (auto custom = env("BATON_SSH")) {
    for (auto word : split_words(*custom)) prefix.emplace_back(word);
  }
  if (prefix.empty()) prefix.emplace_back("ssh");
  for (const char* option : {"-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new"}) {
    prefix.emplace_back(option);
  }
  return prefix;
}

}  // namespace baton::launch
