{{/*
The object store: which one the values choose, the env that points the pods at it, and the
rules that refuse an install whose bytes would live on one pod's disk.
*/}}

{{/*
The store every gateway, worker and the doctor use, as YAML (read it with fromYaml):
- source: dev.minio, blobStore.url, or profile (the profile's storage.blobs table);
- backend: s3 or local;
- url: FLEET_BLOB_URL (empty: the profile's table decides);
- endpoint: the S3 endpoint the chart knows of, for the NetworkPolicy (empty: AWS, or unknown).
*/}}
{{- define "fleet.blobStore" -}}
{{- $url := .Values.blobStore.url }}
{{- if .Values.dev.minio.enabled }}
source: dev.minio
backend: s3
url: {{ printf "s3://%s" .Values.dev.minio.bucket | quote }}
endpoint: {{ printf "http://%s:9000" (include "fleet.componentName" (dict "root" . "suffix" "minio")) | quote }}
{{- else if $url }}
source: blobStore.url
backend: {{ ternary "s3" "local" (hasPrefix "s3://" $url) }}
url: {{ $url | quote }}
endpoint: {{ .Values.blobStore.endpoint | quote }}
{{- else }}
{{- $s := include "fleet.settings" . | fromYaml }}
source: profile
backend: {{ $s.blobBackend | quote }}
url: ""
endpoint: ""
{{- end }}
{{- end }}

{{/*
FLEET_BLOB_URL and the AWS_* variables the S3 client reads itself. The dev MinIO's bucket takes
unsigned requests (AWS_SKIP_SIGNATURE) from this release's pods only (its NetworkPolicy), as the
dev PostgreSQL trusts them: there is no credential to hand out. Otherwise the keys come by
reference, or not at all (the pod's identity: IRSA, EKS Pod Identity).
*/}}
{{- define "fleet.blobEnv" -}}
{{- $store := include "fleet.blobStore" . | fromYaml }}
{{- if $store.url }}
- name: FLEET_BLOB_URL
  value: {{ $store.url | quote }}
{{- end }}
{{- if eq $store.source "dev.minio" }}
- name: AWS_ENDPOINT_URL
  value: {{ $store.endpoint | quote }}
- name: AWS_REGION
  value: us-east-1
- name: AWS_ALLOW_HTTP
  value: "true"
- name: AWS_SKIP_SIGNATURE
  value: "true"
{{- else if eq $store.source "blobStore.url" }}
{{- with .Values.blobStore.endpoint }}
- name: AWS_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
{{- with .Values.blobStore.region }}
- name: AWS_REGION
  value: {{ . | quote }}
{{- end }}
{{- if .Values.blobStore.allowHttp }}
- name: AWS_ALLOW_HTTP
  value: "true"
{{- end }}
{{- if include "fleet.hasSecret" (dict "root" . "ref" .Values.secrets.blobAccessKey) }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    {{- include "fleet.secretKeyRef" (dict "root" . "ref" .Values.secrets.blobAccessKey) | nindent 4 }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    {{- include "fleet.secretKeyRef" (dict "root" . "ref" .Values.secrets.blobSecretKey) | nindent 4 }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The object store's rules (part of fleet.validate). The last one is the point: with the local
backend, attachments, artifacts and workspaces live in each pod's data dir, and one gateway and
one worker are already two pods, so without one ReadWriteMany claim they see different files.
*/}}
{{- define "fleet.validateBlobStore" -}}
{{- $store := include "fleet.blobStore" . | fromYaml }}
{{- $url := .Values.blobStore.url }}
{{- $s3Values := list }}
{{- if .Values.blobStore.endpoint }}{{ $s3Values = append $s3Values "blobStore.endpoint" }}{{ end }}
{{- if .Values.blobStore.region }}{{ $s3Values = append $s3Values "blobStore.region" }}{{ end }}
{{- if .Values.blobStore.allowHttp }}{{ $s3Values = append $s3Values "blobStore.allowHttp" }}{{ end }}
{{- $keys := list }}
{{- range $ref := list "blobAccessKey" "blobSecretKey" }}
{{- if (index $.Values.secrets $ref).key }}
{{- $keys = append $keys $ref }}
{{- $s3Values = append $s3Values (printf "secrets.%s.key" $ref) }}
{{- end }}
{{- end }}
{{- if .Values.dev.minio.enabled }}
{{- $chosen := $s3Values }}
{{- if $url }}{{ $chosen = prepend $chosen "blobStore.url" }}{{ end }}
{{- if $chosen }}
{{- fail (printf "dev.minio.enabled points every pod at the release's own MinIO: unset %s" (join ", " $chosen)) }}
{{- end }}
{{- else if and $s3Values (not (hasPrefix "s3://" $url)) }}
{{- fail (printf "%s configure an s3 store: set blobStore.url=s3://<bucket>[/<prefix>]" (join ", " $s3Values)) }}
{{- end }}
{{- if eq (len $keys) 1 }}
{{- fail "set both secrets.blobAccessKey.key and secrets.blobSecretKey.key, or neither to use the pod's own identity (IRSA, EKS Pod Identity)" }}
{{- end }}
{{- range $keys }}
{{- if not (include "fleet.hasSecret" (dict "root" $ "ref" (index $.Values.secrets .))) }}
{{- fail (printf "secrets.%s.key: set secrets.existingSecret or secrets.%s.name, the Secret that holds it" . .) }}
{{- end }}
{{- end }}
{{- if hasPrefix "file://" $url }}
{{- $path := clean (trimPrefix "file://" $url) }}
{{- $mount := trimSuffix "/" .Values.dataVolume.mountPath }}
{{- if not (or (eq $path $mount) (hasPrefix (printf "%s/" $mount) $path)) }}
{{- fail (printf "blobStore.url %s is outside dataVolume.mountPath (%s), the only volume pods can share: use a folder under it, or an s3:// store" $url .Values.dataVolume.mountPath) }}
{{- end }}
{{- end }}
{{- if and (eq $store.backend "local") (not .Values.dataVolume.existingClaim) }}
{{- $s := include "fleet.settings" . | fromYaml }}
{{- $where := printf "profile %q, storage.blobs.backend = \"local\"" $s.name }}
{{- if $url }}{{ $where = printf "blobStore.url=%s" $url }}{{ end }}
{{- fail (printf "the local blob backend (%s) keeps attachments, artifacts and workspaces on each pod's own disk, and a gateway and a worker are already two pods: set blobStore.url=s3://<bucket> (with secrets.blobAccessKey/blobSecretKey, or the pod's identity), dev.minio.enabled=true for a dev cluster, or dataVolume.existingClaim to a ReadWriteMany PVC" $where) }}
{{- end }}
{{- end }}

{{/*
The TCP ports of the S3 egress rule, as a JSON list: networkPolicy.egress.s3.ports, and
blobStore.endpoint's own port (80 or 443 by its scheme when it names none), so that pointing
the pods at e.g. http://minio.storage:9000 cannot be silently blocked.
*/}}
{{- define "fleet.s3EgressPorts" -}}
{{- $ports := list }}
{{- range .Values.networkPolicy.egress.s3.ports }}
{{- $ports = append $ports (int .) }}
{{- end }}
{{- with .Values.blobStore.endpoint }}
{{- $endpoint := urlParse . }}
{{- $port := regexFind "[0-9]+$" (regexFind ":[0-9]+$" $endpoint.host) }}
{{- if not $port }}{{ $port = ternary "80" "443" (eq $endpoint.scheme "http") }}{{ end }}
{{- if not (has (int $port) $ports) }}{{ $ports = append $ports (int $port) }}{{ end }}
{{- end }}
{{- toJson $ports }}
{{- end }}
