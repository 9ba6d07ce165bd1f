// What both client tests share: named checks that print one line each, and the exit status.
let failures = 0;

export async function check(name, body) {
  try {
    await body();
    console.log(`ok   ${name}`);
  } catch (e) {
    failures += 1;
    console.log(`FAIL ${name}: ${e && e.stack ? e.stack : e}`);
  }
}

export function expect(condition, what) {
  if (!condition) throw new Error(what);
}

export function same(actual, expected, what) {
  expect(JSON.stringify(actual) === JSON.stringify(expected),
         `${what}: ${JSON.stringify(actual)}, expected ${JSON.stringify(expected)}`);
}

/// Prints the summary and exits: 0 when every check passed.
export function finish() {
  console.log(failures === 0 ? 'all checks passed' : `${failures} check(s) failed`);
  process.exit(failures === 0 ? 0 : 1);
}
