// A Packfeed client in another language, written only from protos/packfeed/v1/packfeed.proto and the
// "Writing a client in another language" section of protos/README.md.
//
//   node client.js TARGET PROTO JOB RANK DP MICROBATCHES
//
// Opens the job, streams the rank's packs as PackPart pieces, joins and decodes them, and prints one JSON
// line per pack: its position, sample keys and the SHA-256 of every tensor's bytes (tests/test_node_client.py
// compares them with the Python client's). Exits non-zero with the gRPC status on failure.
"use strict";

const crypto = require("crypto");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const protobuf = require("protobufjs");

const [target, protoPath, job, rank, dp, microbatches] = process.argv.slice(2);
const RECEIVE_LIMIT = 256 * 1024 * 1024; // the server's max_message_mb

const definition = protoLoader.loadSync(protoPath, { keepCase: true, longs: Number, defaults: true });
const packfeed = grpc.loadPackageDefinition(definition).packfeed.v1;
const Pack = new protobuf.Root().loadSync(protoPath, { keepCase: true }).lookupType("packfeed.v1.Pack");

const client = new packfeed.Packfeed(target, grpc.credentials.createInsecure(), {
  "grpc.max_receive_message_length": RECEIVE_LIMIT,
});

function fail(error) {
  console.error(`${grpc.status[error.code]}: ${error.details}`);
  process.exit(2);
}

const plan = { dp: Number(dp), microbatches: Number(microbatches) };
client.OpenJob({ job, plan, seed: 0, epochs: 1 }, (error, info) => {
  if (error) return fail(error);
  const request = { job, rank: Number(rank), first_epoch: 0, first_step: 0, plan_fingerprint: info.plan_fingerprint };
  const stream = client.StreamPackParts(request);
  let pieces = [];
  stream.on("data", (part) => {
    pieces.push(part.data);
    if (!part.last) return;
    const pack = Pack.decode(Buffer.concat(pieces));
    pieces = [];
    const tensors = {};
    for (const [name, tensor] of Object.entries(pack.tensors)) {
      tensors[name] = {
        dtype: tensor.dtype,
        shape: tensor.shape.map(Number),
        sha256: crypto.createHash("sha256").update(tensor.data).digest("hex"),
      };
    }
    console.log(JSON.stringify({
      epoch: pack.epoch, step: Number(pack.step), microbatch: pack.microbatch, empty: pack.empty,
      sample_keys: pack.sample_keys, step_loss_tokens: Number(pack.step_loss_tokens), tensors,
    }));
  });
  stream.on("error", fail);
  stream.on("end", () => {
    if (pieces.length) fail({ code: grpc.status.DATA_LOSS, details: "stream ended inside a pack" });
    client.close();
  });
});
